"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tidal.core.plan import TokenLogprobs
from tidal.core.sampling import SamplingParams

MIN_TEMPERATURE = 1e-5  # (vLLM's _SAMPLING_EPS) a lower one samples as this: logits / 1e-45 overflow float32


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed
        self._request_gens: dict[str, torch.Generator] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._request_gens.pop(rid, None)

    def _gen(self, request_id: str, seed: int) -> torch.Generator:
        g = self._request_gens.get(request_id)
        if g is None:
            g = self._request_gens[request_id] = torch.Generator().manual_seed(seed)
        return g

    @staticmethod
    def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Apply temperature, top-k, top-p and min-p; returns probabilities [S, V]."""
        # a temperature below MIN_TEMPERATURE (a denormal, say) would overflow the logits: it samples as that
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype).clamp_(min=MIN_TEMPERATURE).unsqueeze(1)
        logits = logits / temps
        ks = [p.top_k if p.top_k > 0 else 0 for p in params]
        if any(ks):
            vocab = logits.shape[1]
            kmax = min(max(ks), vocab)
            kth = logits.topk(kmax, dim=-1).values  # [S, kmax], descending
            idx = torch.tensor([min(k, vocab) - 1 if k else kmax - 1 for k in ks]).unsqueeze(1)
            thresh = kth.gather(1, idx)
            off = torch.tensor([k == 0 for k in ks]).unsqueeze(1)
            logits = torch.where(off | (logits >= thresh), logits, torch.full_like(logits, -float("inf")))
        probs = logits.softmax(-1)
        tops = [p.top_p for p in params]
        if any(t < 1.0 for t in tops):
            sp, si = probs.sort(dim=-1, descending=True)
            cum = sp.cumsum(-1)
            top_p = torch.tensor(tops, dtype=probs.dtype).unsqueeze(1)
            drop_sorted = (cum - sp) >= top_p  # keep the smallest prefix whose mass reaches top_p
            drop_sorted[:, 0] = False  # and the likeliest token always (a top_p that rounds to 0 in float32)
            drop = torch.zeros_like(drop_sorted).scatter(1, si, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        mins = [p.min_p for p in params]
        if any(m > 0 for m in mins):
            min_p = torch.tensor(mins, dtype=probs.dtype).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
        return probs / probs.sum(-1, keepdim=True)

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str],
               params: Sequence[SamplingParams]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [S, V] float32 on any device. Returns token ids and optional logprobs."""
        greedy = [p.greedy for p in params]
        tokens = logits.argmax(-1)
        random_rows = [i for i, g in enumerate(greedy) if not g]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            sub = logits[rows].float().cpu()
            probs = self._filter(sub, [params[i] for i in random_rows])
            picked = torch.empty(len(random_rows), dtype=torch.long)
            plain = []
            for j, i in enumerate(random_rows):
                seed = params[i].seed
                if seed is not None:
                    g = self._gen(request_ids[i], seed)
                    picked[j] = torch.multinomial(probs[j], 1, generator=g)[0]
                else:
                    plain.append(j)
            if plain:
                pj = torch.tensor(plain)
                p = probs[pj]
                q = torch.empty_like(p).exponential_(generator=self.generator)
                picked[pj] = (p / q).argmax(-1)  # exponential-race sampling == multinomial
            tokens = tokens.cpu()
            tokens[rows.cpu()] = picked
        token_list = tokens.tolist()
        lps: list[TokenLogprobs | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            rows = torch.tensor(want, device=logits.device)
            logp = logits[rows].float().log_softmax(-1)
            k = max(params[i].logprobs for i in want)
            top_v, top_i = (logp.topk(k, dim=-1) if k else (None, None))
            chosen = logp.gather(1, torch.tensor([token_list[i] for i in want], device=logits.device).unsqueeze(1))
            chosen = chosen.squeeze(1).tolist()
            top_v = top_v.tolist() if k else None
            top_i = top_i.tolist() if k else None
            for j, i in enumerate(want):
                n = params[i].logprobs
                lps[i] = token_logprobs(token_list[i], chosen[j], top_i[j] if n else (), top_v[j] if n else (), n)
        return token_list, lps


def token_logprobs(token: int, chosen: float, top_ids: Sequence[int], top_values: Sequence[float],
                   n: int) -> TokenLogprobs:
    """A sampled token's log-probability and the ``n`` likeliest (id, log-probability), likeliest first."""
    return TokenLogprobs(token, chosen, tuple(zip(top_ids[:n], top_values[:n], strict=True)) if n else ())
