// tidal's small time-series chart on a <canvas>: lines over wall-clock time, a y axis from 0,
// a legend. No dependencies. Shipped in the tidal package (tidal/server/static), Apache-2.0.
"use strict";

(function () {
  const PAD = { left: 52, right: 30, top: 22, bottom: 24 };

  function niceStep(max, ticks) {
    const raw = max / ticks;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    for (const m of [1, 2, 2.5, 5, 10]) {
      if (raw <= m * mag) return m * mag;
    }
    return 10 * mag;
  }

  function clock(t) {
    const d = new Date(t * 1000);
    return d.toTimeString().slice(0, 8);
  }

  class TimeChart {
    // opts: {windowS: seconds shown, yMax: fixed top (else from the data), unit: text after
    //        y labels, format: value -> text}
    constructor(canvas, opts) {
      this.canvas = canvas;
      this.opts = Object.assign({ windowS: 300, yMax: null, unit: "", format: null }, opts || {});
      this.series = [];
      this.now = Date.now() / 1000;
    }

    // series: [{name, color, points: [[unixSeconds, value or null], ...]}]
    draw(series, now) {
      this.series = series;
      this.now = now || Date.now() / 1000;
      const c = this.canvas;
      const ratio = window.devicePixelRatio || 1;
      const w = c.clientWidth || 400, h = c.clientHeight || 160;
      if (c.width !== Math.round(w * ratio) || c.height !== Math.round(h * ratio)) {
        c.width = Math.round(w * ratio);
        c.height = Math.round(h * ratio);
      }
      const g = c.getContext("2d");
      g.setTransform(ratio, 0, 0, ratio, 0, 0);
      g.clearRect(0, 0, w, h);
      const x0 = PAD.left, x1 = w - PAD.right, y0 = h - PAD.bottom, y1 = PAD.top;
      const t1 = this.now, t0 = t1 - this.opts.windowS;
      let max = this.opts.yMax;
      if (max === null) {
        max = 0;
        for (const s of series) for (const p of s.points) if (p[0] >= t0 && p[1] !== null && p[1] > max) max = p[1];
        max = max > 0 ? max * 1.15 : 1;
      }
      const step = niceStep(max, 4);
      const top = Math.ceil(max / step - 1e-9) * step || step;
      const fmt = this.opts.format || ((v) => (Math.abs(v) >= 100 ? v.toFixed(0) : +v.toPrecision(3)) + this.opts.unit);
      const X = (t) => x0 + ((t - t0) / (t1 - t0)) * (x1 - x0);
      const Y = (v) => y0 - (v / top) * (y0 - y1);
      g.font = "11px sans-serif";
      g.lineWidth = 1;
      g.strokeStyle = "#e3e6ea";
      g.fillStyle = "#555";
      g.textAlign = "right";
      g.textBaseline = "middle";
      for (let v = 0; v <= top + 1e-9; v += step) {
        g.beginPath();
        g.moveTo(x0, Y(v));
        g.lineTo(x1, Y(v));
        g.stroke();
        g.fillText(fmt(v), x0 - 4, Y(v));
      }
      g.textAlign = "center";
      g.textBaseline = "top";
      const xticks = 4;
      for (let i = 0; i <= xticks; i++) {
        const t = t0 + (i / xticks) * (t1 - t0);
        g.fillText(clock(t), X(t), y0 + 6);
      }
      g.strokeStyle = "#888";
      g.beginPath();
      g.moveTo(x0, y1);
      g.lineTo(x0, y0);
      g.lineTo(x1, y0);
      g.stroke();
      let lx = x0;
      g.textAlign = "left";
      g.textBaseline = "middle";
      for (const s of series) {
        g.strokeStyle = s.color;
        g.fillStyle = s.color;
        g.lineWidth = 2;
        g.beginPath();
        let pen = false;
        for (const p of s.points) {
          if (p[0] < t0 || p[1] === null) { pen = false; continue; }
          const px = X(p[0]), py = Y(Math.min(p[1], top));
          if (pen) g.lineTo(px, py); else g.moveTo(px, py);
          pen = true;
        }
        g.stroke();
        const last = s.points.filter((p) => p[0] >= t0 && p[1] !== null);
        if (last.length === 1) {  // a single point draws no line: a dot
          g.beginPath();
          g.arc(X(last[0][0]), Y(Math.min(last[0][1], top)), 2.5, 0, 2 * Math.PI);
          g.fill();
        }
        g.fillRect(lx, 6, 10, 10);
        g.fillStyle = "#333";
        g.fillText(s.name, lx + 14, 11);
        lx += 24 + g.measureText(s.name).width;
      }
    }
  }

  window.TidalChart = { TimeChart: TimeChart };
})();
