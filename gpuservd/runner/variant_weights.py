"""A variant's weights: a shared base's ModelWeights plus a delta applied at run time.

The base's tensors are never copied or changed: the base's own engine and every
other variant read the same objects, so adding a delta into them would change
every model that shares them. A targeted projection becomes a
`DeltaLinear`: y = base(x) + delta(x), where the delta is
- LoRA (unmerged): scale * B (A x); the A of every adapter on one fused projection
  are stacked so x meets them in one matmul, then each B adds into its slice of
  the fused output (q/k/v of `qkv`, gate/up of `gate_up`);
- full rank: dW x, one `Linear` per run of adjacent targeted slices.
A model with no delta never sees any of this: its layers are plain LayerWeights.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from gpuservd.runner.linear import Linear
from gpuservd.runner.model_weights import LayerWeights, ModelWeights


@dataclass
class LoraPart:
    start: int  # first output column of the fused projection this adapter adds to
    end: int  # one past the last
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [end - start, r]
    scale: float  # lora_alpha / r (PEFT's scaling)


@dataclass
class FullPart:
    start: int
    end: int
    delta: torch.Tensor  # dW [end - start, in]


@dataclass
class DeltaTerm:
    """Everything a variant adds to one fused projection's output, ready to run."""

    lora: list[LoraPart] = field(default_factory=list)
    full: list[FullPart] = field(default_factory=list)

    def build(self, onednn: bool) -> "_BuiltTerm":
        return _BuiltTerm(self, onednn)


class _BuiltTerm:
    def __init__(self, term: DeltaTerm, onednn: bool):
        parts = sorted(term.lora, key=lambda p: p.start)
        # x [T, in] @ a^T -> [T, R]: every adapter's A in one matmul.
        self.a = torch.cat([p.a for p in parts]).contiguous() if parts else None
        self.lora = []  # (start, end, r0, r1, scale * B^T [r, out])
        r0 = 0
        for p in parts:
            r = p.a.shape[0]
            self.lora.append((p.start, p.end, r0, r0 + r, (p.b * p.scale).t().contiguous()))
            r0 += r
        self.full = []  # (start, end, Linear over dW of adjacent slices)
        run: list[FullPart] = []
        for p in sorted(term.full, key=lambda p: p.start) + [None]:
            if run and (p is None or p.start != run[-1].end):
                self.full.append((run[0].start, run[-1].end,
                                  Linear(torch.cat([q.delta for q in run]).contiguous(), None, onednn)))
                run = []
            if p is not None:
                run.append(p)
        self.nbytes = sum(t.numel() * t.element_size() for t in
                          ([self.a] if self.a is not None else []) + [bt for *_, bt in self.lora]) + \
            sum(lin.nbytes for *_, lin in self.full)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y [T, out] += delta(x [T, in]), in place."""
        if self.a is not None:
            xa = F.linear(x, self.a)  # [T, R]
            for start, end, r0, r1, bt in self.lora:
                y[:, start:end].addmm_(xa[:, r0:r1], bt)
        for start, end, lin in self.full:
            y[:, start:end] += lin(x)
        return y


class DeltaLinear:
    """A shared base Linear plus a variant's delta on its output; called like a Linear."""

    def __init__(self, base: Linear, term: _BuiltTerm):
        self.base = base
        self.term = term
        self.nbytes = term.nbytes  # the variant's own bytes; the base's are the base's

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.term.add_to(self.base(x), x)


PROJ_FIELDS = ("qkv", "o_proj", "gate_up", "down")


class VariantWeights:
    """Quacks like ModelWeights for LlamaModel: the base's embeddings, norms, head and layers,
    with DeltaLinear in place of each targeted projection. nbytes() is the delta's alone."""

    def __init__(self, base: ModelWeights, terms: dict[int, dict[str, _BuiltTerm]]):
        self.base = base
        self.terms = terms  # layer -> LayerWeights field (qkv | o_proj | gate_up | down) -> its delta
        self.embed = base.embed
        self.final_norm = base.final_norm
        self.lm_head = base.lm_head
        self.gate = None  # the base's own gate (layered load) is waited on through base.layer(i)
        self._layers: list[LayerWeights | None] = [None] * len(base.layers)
        self._delta_bytes = sum(t.nbytes for per in terms.values() for t in per.values())

    @property
    def layers(self) -> list[LayerWeights | None]:
        return [self.layer(i) for i in range(len(self._layers))]

    def nbytes(self) -> int:
        return self._delta_bytes

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.base.embed_tokens(ids)

    def layer(self, i: int) -> LayerWeights:
        """The base's layer i (waiting for it if the base is still streaming in) with the delta on top."""
        lw = self._layers[i]
        if lw is None:
            base = self.base.layer(i)
            per = self.terms.get(i)
            lw = base if not per else replace(base, **{f: DeltaLinear(getattr(base, f), t) for f, t in per.items()})
            self._layers[i] = lw
        return lw
