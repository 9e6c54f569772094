"""Reuse statistics, counted per scheduler iteration (reset when read)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ReuseStats:
    """Counters of the lookups made by ``create_kv_cache`` since the last read."""

    lookups: int = 0
    lookup_tokens: int = 0
    reused_tokens: int = 0
    full_block_reuses: int = 0  # reuse ends on a block boundary
    partial_block_reuses: int = 0  # reuse ends inside a block (a rewind endpoint)
    ssm_lookups: int = 0
    ssm_hits: int = 0
    ssm_misses: int = 0
    ssm_reused_tokens: int = 0
    ssm_unreused_tokens: int = 0
    ssm_aligned_hits: int = 0
    ssm_unaligned_hits: int = 0

    def record(self, looked_up: int, reused: int, T: int, has_ssm: bool):
        self.lookups += 1
        self.lookup_tokens += looked_up
        self.reused_tokens += reused
        if reused:
            if reused % T:
                self.partial_block_reuses += 1
            else:
                self.full_block_reuses += 1
        if has_ssm:
            self.ssm_lookups += 1
            self.ssm_reused_tokens += reused
            self.ssm_unreused_tokens += looked_up - reused
            if reused:
                self.ssm_hits += 1
                if reused % T:
                    self.ssm_unaligned_hits += 1
                else:
                    self.ssm_aligned_hits += 1
            else:
                self.ssm_misses += 1

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def ssm_dict(self) -> dict:
        if not self.ssm_lookups:
            return {}
        d = {k[4:]: v for k, v in self.__dict__.items() if k.startswith("ssm_")}
        d["hit_rate"] = self.ssm_hits / self.ssm_lookups
        return d
