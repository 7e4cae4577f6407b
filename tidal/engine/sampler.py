"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidal.core.plan import TokenLogprobs
from tidal.core.sampling import SamplingParams

# top-p on the CPU: the likeliest this many tokens (the fewest first) are sorted alone when they hold every
# row's top_p; on 32 rows of 49,152, a top-256 took 2.7 ms, a top-4096 11 ms and a whole sort 56 ms
TOP_P_CANDIDATES = (256, 4096)
# rows that all keep their top k, k at most this, are drawn among their likeliest k tokens alone
TOP_K_DIRECT = 4096
MIN_TEMPERATURE = 1e-5  # (vLLM's _SAMPLING_EPS) a lower one samples as this: logits / 1e-45 overflow float32


def _small(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A few per-row values as a tensor on ``device``, copied from pinned memory without waiting for the
    device's queue (a plain copy from pageable memory would wait for it: a step run ahead of the host,
    --async-scheduling, samples before the step before has finished)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


class Sampler:
    """Draws on the logits' device: on the CPU with CPU generators, on CUDA with CUDA generators (each seeded
    as the CPU's, though their streams differ, so a seeded request's tokens on CUDA are not the CPU's)."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed
        self._device_generators: dict[torch.device, torch.Generator] = {}
        self._request_gens: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._request_gens.pop(rid, None)

    def _gen(self, request_id: str, seed: int, device: torch.device) -> torch.Generator:
        g = self._request_gens.get(request_id)
        if g is None:
            g = self._request_gens[request_id] = torch.Generator(device=device).manual_seed(seed)
        return g

    def _engine_gen(self, device: torch.device) -> torch.Generator:
        """The generator of requests without a seed, on ``device``."""
        if device.type == "cpu":
            return self.generator
        g = self._device_generators.get(device)
        if g is None:
            g = self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return g

    @staticmethod
    def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Apply temperature, top-k, top-p and min-p; returns each row's weights [S, V]: its probabilities
        with the filtered-out tokens at 0, not normalized again (a draw scales by the row's total)."""
        dev = logits.device
        # a temperature below MIN_TEMPERATURE (a denormal, say) would overflow the logits: it samples as that
        temps = _small([p.temperature for p in params], logits.dtype, dev).clamp_(min=MIN_TEMPERATURE).unsqueeze(1)
        logits = logits / temps
        ks = [p.top_k if p.top_k > 0 else 0 for p in params]
        if any(ks):
            vocab = logits.shape[1]
            kmax = min(max(ks), vocab)
            kth = logits.topk(kmax, dim=-1).values  # [S, kmax], descending
            idx = _small([min(k, vocab) - 1 if k else kmax - 1 for k in ks], torch.long, dev).unsqueeze(1)
            thresh = kth.gather(1, idx)
            off = _small([k == 0 for k in ks], torch.bool, dev).unsqueeze(1)
            logits = torch.where(off | (logits >= thresh), logits, torch.full_like(logits, -float("inf")))
        probs = logits.softmax(-1)
        tops = [p.top_p for p in params]
        if any(t < 1.0 for t in tops):
            probs = Sampler._top_p(probs, _small(tops, probs.dtype, dev).unsqueeze(1))
        mins = [p.min_p for p in params]
        if any(m > 0 for m in mins):
            min_p = _small(mins, probs.dtype, dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
        return probs

    @staticmethod
    def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Keep each row's smallest prefix of its tokens, likeliest first, whose mass reaches its ``top_p``
        (the likeliest token always: a top_p that rounds to 0 in float32), zero the rest. On the CPU, where a
        sort of the whole vocabulary is the sampler's largest cost, the likeliest TOP_P_CANDIDATES tokens
        (the fewest first) are sorted alone when they hold every row's top_p (a language model's
        distribution, not a flat one): the prefix lies among them."""
        for k in TOP_P_CANDIDATES if probs.device.type == "cpu" else ():
            if k >= probs.shape[1]:
                break
            sp, si = probs.topk(k, dim=-1)  # sorted, likeliest first
            cum = sp.cumsum(-1)
            if bool((cum[:, -1:] >= top_p).all()):
                keep = (cum - sp) < top_p
                keep[:, 0] = True
                return torch.zeros_like(probs).scatter(1, si, sp * keep)
        sp, si = probs.sort(dim=-1, descending=True)
        cum = sp.cumsum(-1)
        drop_sorted = (cum - sp) >= top_p
        drop_sorted[:, 0] = False
        return probs.masked_fill(torch.zeros_like(drop_sorted).scatter(1, si, drop_sorted), 0.0)

    @staticmethod
    def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Each row's first token whose cumulative weight reaches ``1 - u`` (``u`` uniform in [0, 1)) of the
        row's total: a draw from the row's distribution with one random number. The point lies in (0,
        total], so the token found always has a weight above 0."""
        cum = weights.cumsum(-1)
        idx = torch.searchsorted(cum, (1 - u).unsqueeze(1) * cum[:, -1:])
        return idx.squeeze(1).clamp_(max=weights.shape[1] - 1)  # (a row of NaN logits: not past the end)

    @staticmethod
    def _draw_among_top_k(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
        """``_filter`` and ``_inverse_cdf`` for rows that each keep only their top k (k <= TOP_K_DIRECT), done
        on the likeliest max-k tokens alone, which come sorted: temperature, each row's k, softmax, top-p
        (the sorted prefix, no sort), min-p (against the first), then the draw; a token's id is its
        candidate's. (Where the k-th likeliest token ties with the next, these keep exactly k, ``_filter``
        every tied token.)"""
        dev = logits.device
        kmax = min(max(p.top_k for p in params), logits.shape[1])
        vals, ids = logits.topk(kmax, dim=-1)  # sorted, likeliest first
        temps = _small([p.temperature for p in params], vals.dtype, dev).clamp_(min=MIN_TEMPERATURE).unsqueeze(1)
        vals = vals / temps
        ks = _small([min(p.top_k, kmax) for p in params], torch.long, dev).unsqueeze(1)
        vals = vals.masked_fill(torch.arange(kmax, device=dev).unsqueeze(0) >= ks, -float("inf"))
        probs = vals.softmax(-1)
        tops = [p.top_p for p in params]
        if any(t < 1.0 for t in tops):
            keep = (probs.cumsum(-1) - probs) < _small(tops, probs.dtype, dev).unsqueeze(1)
            keep[:, 0] = True
            probs = probs * keep
        mins = [p.min_p for p in params]
        if any(m > 0 for m in mins):
            probs = probs.masked_fill(probs < _small(mins, probs.dtype, dev).unsqueeze(1) * probs[:, :1], 0.0)
        return ids.gather(1, Sampler._inverse_cdf(probs, u).unsqueeze(1)).squeeze(1)

    def draw(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
             ) -> torch.Tensor:
        """The sampled token of each row, as a tensor on the logits' device, read by nobody yet: the argmax
        for greedy rows, a draw from the filtered distribution for the others (a request's own generator
        when it has a seed, else the engine's). Nothing here waits for the device."""
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return logits.argmax(-1)
        dev = logits.device
        every = len(random_rows) == len(params)
        rows = None if every else _small(random_rows, torch.long, dev)
        sub = logits.float() if every else logits[rows].float()
        chosen = [params[i] for i in random_rows]
        # one uniform number a row: a request's own generator when it has a seed, else the engine's (in row
        # order); drawn where the logits are, never waiting for the device
        u = torch.empty(len(random_rows), dtype=torch.float32, device=dev)
        plain = []
        for j, i in enumerate(random_rows):
            seed = params[i].seed
            if seed is not None:
                u[j:j + 1].uniform_(generator=self._gen(request_ids[i], seed, dev))
            else:
                plain.append(j)
        if plain:
            u[_small(plain, torch.long, dev)] = torch.rand(len(plain), dtype=torch.float32, device=dev,
                                                           generator=self._engine_gen(dev))
        kmax = max(p.top_k for p in chosen)
        if min(p.top_k for p in chosen) > 0 and kmax <= TOP_K_DIRECT:  # every row keeps its top k: among them
            picked = self._draw_among_top_k(sub, chosen, u)
        else:
            picked = self._inverse_cdf(self._filter(sub, chosen), u)
        if every:
            return picked
        tokens = logits.argmax(-1)
        tokens[rows] = picked
        return tokens

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str],
               params: Sequence[SamplingParams]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [S, V] float32 on any device. Returns token ids and optional logprobs."""
        tokens = self.draw(logits, request_ids, params)
        token_list = tokens.tolist()
        lps: list[TokenLogprobs | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            rows = torch.tensor(want, device=logits.device)
            k = max(params[i].logprobs for i in want)
            parts = [t.tolist() for t in logprob_parts(logits[rows], tokens[rows], k)]
            for j, i in enumerate(want):
                lps[i] = token_logprobs(token_list[i], params[i].logprobs, j, parts)
        return token_list, lps


def logprob_parts(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[torch.Tensor]:
    """Each row's log-probability of its sampled token and, when ``k``, its ``k`` likeliest tokens'
    (values, ids): ``[chosen]`` or ``[chosen, top_values, top_ids]``, where the logits are (one row's
    log-softmax does not depend on the others')."""
    logp = logits.float().log_softmax(-1)
    return [logp.gather(1, tokens.unsqueeze(1)).squeeze(1), *(logp.topk(k, dim=-1) if k else ())]


def token_logprobs(token: int, n: int, row: int, parts: list[list]) -> TokenLogprobs:
    """Row ``row``'s record from :func:`logprob_parts` (as lists): its sampled token's log-probability and
    the ``n`` likeliest (id, log-probability), likeliest first."""
    chosen, *top = parts
    if not n:
        return TokenLogprobs(token, chosen[row], ())
    top_values, top_ids = top
    return TokenLogprobs(token, chosen[row], tuple(zip(top_ids[row][:n], top_values[row][:n], strict=True)))
