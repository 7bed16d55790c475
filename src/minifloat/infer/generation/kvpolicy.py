"""The eviction policy of a `KVCache`: which tokens move to which format, or leave, as the
cache grows. Its decisions, apart from the storage they act on (`kvcache`: runs, demote, keep):

- a recent window (``recent_format``): tokens enter in it and move to ``format`` once they are
  neither among the first ``sink_tokens`` (attention sinks) nor the last ``recent_tokens``
  (KIVI's residual; with channel-scaled keys, a whole group at a time);
- a budget (``budget_bytes``, FP8 normally, FP4 under memory pressure): when appending would take
  the cache past it, the oldest tokens (but the sinks and the recent window) move to
  ``pressure_format``, at least `DEMOTE_AT_ONCE` at a time; each layer keeps to its equal share;
- dropping (``drop=True``, StreamingLLM's eviction): past the budget even in ``pressure_format``,
  the oldest tokens after the sinks leave the cache, and positions keep counting them.

A budget that cannot hold the next tokens is an error before anything is stored or dropped.
"""

from __future__ import annotations

import torch

from minifloat.errors import MinifloatError
from minifloat.infer.generation.kvspec import kv_format

DEMOTE_AT_ONCE = 16  # tokens a move takes at least: fewer, larger chunks (each NVFP4 chunk holds a tensor scale)


class KVPolicy:
    """The policy half of `KVCache` (a mixin: the cache's runs, spec and storage operations are
    the other half)."""

    def _age(self, layer: int) -> None:
        """Move the tokens that left the recent window (not the sinks) from `recent_format` to `format`."""
        lo, hi = self.sink_tokens, self.length(layer) - self.recent_tokens
        start, i = 0, 0
        while i < len(self._runs[layer]):
            run = self._runs[layer][i]
            a, b = max(start, lo), min(start + run.tokens, hi)
            if self.key_scales == "channel":  # channel scales: whole groups of tokens only
                b = a + (b - a) // self.group * self.group
            if run.fmt == self.recent_format and a < b:
                self._demote(layer, i, start, a - start, b - start, self.format)
                start, i = 0, 0  # the runs were split and merged: walk them again
                continue
            start += run.tokens
            i += 1

    def least_bytes(self, new_tokens: int) -> int:
        """The fewest bytes the cache can hold its tokens and `new_tokens` more in: all but the
        sinks and the recent window in `pressure_format` (every layer; the shape must be known)."""
        n = self.length(0) + new_tokens
        kept = min(n, self.sink_tokens + self.recent_tokens)
        # per-chunk bytes beyond the per-token ones (NVFP4's tensor scales): those held, and two more chunks
        extra = self.layer_bytes(0) - sum(run.tokens * self.token_bytes(kv_format(run.fmt)) for run in self._runs[0])
        extra += 16 if not isinstance(self.pressure, torch.dtype) and self.pressure.is_nvfp4 else 0
        entry = kv_format(self.entry_format)
        return self.n_layer * (kept * self.token_bytes(entry) + (n - kept) * self.token_bytes(self.pressure) + extra)

    def _check_budget(self, t: int) -> None:
        n = self.length(0) + t
        least = self.least_bytes(t)
        if least > self.budget_bytes and self.drop:
            # each dropped token frees at least its bytes in pressure_format, in every layer
            per = self.n_layer * self.token_bytes(self.pressure)
            want = -(-(least - self.budget_bytes) // max(per, 1))
            room = self.length(0) - self.sink_tokens - max(self.recent_tokens - t, 0)
            if 0 < want <= room:
                self._drop(max(want, min(DEMOTE_AT_ONCE, room)))
                n, least = self.length(0) + t, self.least_bytes(t)
        if least > self.budget_bytes:
            raise MinifloatError(
                f"the KV budget of {self.budget_bytes:,} bytes cannot hold {n} tokens even with all but the "
                f"{self.sink_tokens} first and {self.recent_tokens} last in {self.pressure_format} ({least:,} bytes); "
                + ("even dropping every token between them does not make room" if self.drop else
                   "nothing was dropped: raise the budget, shorten the sequence, or allow dropping (drop=True)")
            )

    def _fit(self, layer: int) -> None:
        share = self.budget_bytes // self.n_layer
        saving = self.token_bytes(self.store) - self.token_bytes(self.pressure)
        while self.layer_bytes(layer) > share:
            n = self.length(layer)
            lo, hi = self.sink_tokens, n - self.recent_tokens
            # at least DEMOTE_AT_ONCE tokens a move: fewer, larger chunks (each NVFP4 chunk holds a tensor scale)
            need = max(DEMOTE_AT_ONCE, -(-(self.layer_bytes(layer) - share) // max(saving, 1)))
            start = 0
            for i, run in enumerate(self._runs[layer]):
                a, b = max(start, lo), min(start + run.tokens, hi)
                if run.fmt == self.format and a < b:
                    self._demote(layer, i, start, a - start, min(b, a + need) - start, self.pressure_format)
                    break
                start += run.tokens
            else:
                raise MinifloatError(f"the KV budget of {self.budget_bytes:,} bytes is exceeded and no token can move to "
                                     f"{self.pressure_format}")  # fmt: skip

    def _drop(self, n: int) -> None:
        """Remove the `n` oldest tokens after the sinks from every layer."""
        lo, hi = self.sink_tokens, self.sink_tokens + n
        for layer in range(self.n_layer):
            self._keep(layer, lo, hi)
        self.events.append({"layer": "all", "tokens": [lo + self.dropped, hi + self.dropped], "from": "held", "to": "dropped",
                            "layer_bytes_after": self.layer_bytes(0)})  # fmt: skip
        self.dropped += n
