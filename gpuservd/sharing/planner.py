"""The sharing plan: SM partitions per model group and per-model memory quotas.

Pure Python and no torch, so `gpuserv plan` answers at once and the daemon can recompute the plan
whenever its set of models changes.

SM partitions
------------------
Each model's compute share (SharingConfig.shares) becomes SMs; models naming the same `group`
share one partition and their shares add up. For a group with share s on a device of N SMs:

1. ideal = s x N (`raw_sms`);
2. round it to the nearest multiple of 8 SMs, the seed's recommended unit (halves round up);
   a group too small for one unit (ideal < 4) gets the smallest valid partition that holds it;
3. never below the device's minimum green-context partition (see `hardware.granularity`:
   4 SMs on 8.x, 2 on 7.x, 8 on 9.0+), and always a multiple of its alignment (2 SMs = one TPC
   on 7.x/8.x, 8 on 9.0+);
4. if the rounded groups add up to more than N, take SMs back one alignment step at a time from the
   group rounded up the most (largest num_sms - raw_sms; ties: the larger group, then the one
   listed last), never below the minimum;
5. what is left is the spare: the elastic buffer, not handed to anyone.

The seed's example comes out exactly: A100, 108 SMs, 40/35/25% -> ideal 43.2/37.8/27 ->
40/40/24 SMs + 4 spare.

More groups than the device has minimum partitions (groups x minimum > N) cannot be planned: a
UserError names the numbers and the way out (a shared `group`). A group with no share left (the
listed shares already add up to 1) still gets the minimum partition, with a warning, since a model
on the device must run somewhere.

Memory quotas
------------------
quota = need x (1 + headroom), need = weights + peak KV + peak activations + framework overhead.
Each term comes from the model's sharing settings when given (weights_bytes, kv_peak_bytes,
activation_bytes, overhead_bytes; memory_quota_bytes fixes the quota itself), else:

- weights: the store's parameter count x the compute dtype's size (engine.dtype);
- peak KV: the KV pool the engine allocates (engine.kv_cache_bytes, else kv_cache_fraction of
  device_memory_bytes minus the weights, as runner/model_runner.py does);
- activations: `estimate_activation_bytes` from the model's shape and the scheduler's token budget;
- overhead: 512 MiB on CUDA (context, cuBLAS workspace, allocator slack), 0 on the CPU.

The seed's 7B fp16 model: 14 + 8 + 2 + 1 = 25 GB need, 30 GB quota with 20% headroom, two per
80 GB card (`fits`: floor(device memory / quota)). Quotas that add up to more than the device's
memory are a warning, not an error: the models beyond what fits wait in the host tier (swap-out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpuservd.config import EngineConfig
from gpuservd.dtypes import choose_dtype
from gpuservd.errors import ModelNotFound, UserError
from gpuservd.runner.model_config import load_arch
from gpuservd.sharing.hardware import Hardware, SmGranularity
from gpuservd.store.store import ModelStore

RECOMMENDED_STEP = 8  # partitions are recommended in multiples of 8 SMs (Hopper's alignment; a plan
# in such steps fits every generation)
CUDA_OVERHEAD_BYTES = 512 * 1024**2  # per model: CUDA context share, cuBLAS workspace, allocator slack
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


def _ceil_to(x: float, step: int) -> int:
    return int(math.ceil(x / step - 1e-9)) * step


@dataclass
class Group:
    """One SM partition and the models that take turns on it."""

    name: str
    models: list[str]
    share: float  # of the device's SMs, the members' shares added
    raw_sms: float  # share x num_sms, before rounding
    num_sms: int  # what the partition gets

    def to_dict(self) -> dict:
        return {"name": self.name, "models": list(self.models), "share": round(self.share, 6),
                "raw_sms": round(self.raw_sms, 3), "num_sms": self.num_sms}


def allocate_sms(shares: dict[str, float], num_sms: int, gran: SmGranularity,
                 recommended: int = RECOMMENDED_STEP) -> tuple[dict[str, int], list[str]]:
    """SMs per group (rules in the module docstring) and warnings; the spare is num_sms - sum."""
    names = list(shares)
    if not names:
        return {}, []
    bad = [n for n in names if not 0 <= shares[n] <= 1]
    if bad:
        raise UserError(f"share of {bad[0]!r} must be in [0, 1], got {shares[bad[0]]}")
    total_share = sum(shares.values())
    if total_share > 1 + 1e-9:
        raise UserError(f"the shares add up to {total_share:.2f}; they must add up to at most 1.0")
    align = gran.align_sms
    min_sms = _ceil_to(gran.min_sms, align)
    step = _ceil_to(recommended, align)
    if len(names) * min_sms > num_sms:
        raise UserError(
            f"{len(names)} SM groups need at least {len(names)} x {min_sms} = {len(names) * min_sms} SMs "
            f"(the smallest partition here is {min_sms} SMs) but the device has {num_sms}; put models in a "
            "shared group (sharing.models.<name>.group) or plan fewer models")
    raw = {n: shares[n] * num_sms for n in names}
    alloc = {}
    for n in names:
        a = int(math.floor(raw[n] / step + 0.5)) * step
        if a < min_sms:
            a = max(min_sms, _ceil_to(raw[n], align))
        alloc[n] = a
    order = {n: i for i, n in enumerate(names)}
    total = sum(alloc.values())
    while total > num_sms:
        # Candidates always exist: a group above the minimum can give a step, and if every group sat
        # at the minimum the total would be len(names) x min_sms <= num_sms (checked above).
        candidates = [n for n in names if alloc[n] - align >= min_sms]
        n = max(candidates, key=lambda n: (alloc[n] - raw[n], alloc[n], order[n]))
        alloc[n] -= align
        total -= align
    warnings = []
    for n in names:
        if shares[n] == 0:
            warnings.append(f"{n} has no share left (the listed shares add up to {total_share:.2f}); "
                            f"it gets the minimum partition, {alloc[n]} SMs")
        elif abs(alloc[n] - raw[n]) > max(step, align):
            warnings.append(f"{n} gets {alloc[n]} SMs, far from its ideal {raw[n]:.1f}: the minimum partitions "
                            "of the other groups leave no better split")
    return alloc, warnings


# ---- memory quotas -----------------------------------------------------------------------------

def kv_bytes_per_token(arch, dtype_bytes: int) -> int:
    """K and V of every layer for one token."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * dtype_bytes


def max_model_len(arch, engine) -> int:
    """The context the engine allows (engine.max_model_len capped by the model's, and its sliding window)."""
    limit = arch.max_position_embeddings
    if arch.sliding_window:
        limit = min(limit, arch.sliding_window)
    return min(limit, engine.max_model_len) if engine.max_model_len else limit


def estimate_activation_bytes(arch, dtype_bytes: int, max_batched_tokens: int, max_prefill_tokens: int,
                              max_num_seqs: int, max_len: int) -> int:
    """Peak activation memory of one forward step, an upper bound (the terms are added, though some are
    freed before others are made). T = tokens per step, P = prefill chunk, L = context, S = sampled rows,
    b = compute dtype bytes, H / KV heads, hd = head dim, V = vocabulary:

    - one layer's hidden work:  b x T x (2 hidden (residual + normed) + (H + 2 KV) hd (q, k, v)
                                          + H hd (attention out) + 3 intermediate (gate, up, their product))
    - one prefill chunk's attention over its context (runner/attention.py gathers the cached K/V and
      expands it to every query head, and a masked SDPA may materialise the scores):
                                b x (2 H L hd + H P L)
    - logits and probabilities over the vocabulary for the sampled rows, fp32:  4 x 2 x S x V
    """
    hd = arch.head_dim
    hidden = dtype_bytes * max_batched_tokens * (
        2 * arch.hidden_size + (arch.num_heads + 2 * arch.num_kv_heads) * hd + arch.num_heads * hd
        + 3 * arch.intermediate_size)
    chunk = min(max_prefill_tokens, max_len)
    attention = dtype_bytes * (2 * arch.num_heads * max_len * hd + arch.num_heads * chunk * max_len)
    rows = min(max_num_seqs, max_batched_tokens)
    logits = 4 * 2 * rows * arch.vocab_size
    return int(hidden + attention + logits)


@dataclass
class MemoryQuota:
    """One model's memory quota and what it is made of (bytes)."""

    model: str
    weights: int | None
    kv_peak: int | None
    activations: int | None
    overhead: int | None
    headroom: float
    quota: int
    fixed: bool = False  # memory_quota_bytes was given; the terms are informative (None = unknown)
    sources: dict[str, str] = field(default_factory=dict)  # term -> config | store | engine | estimate | default

    @property
    def need(self) -> int | None:
        terms = (self.weights, self.kv_peak, self.activations, self.overhead)
        return None if any(t is None for t in terms) else sum(terms)

    def to_dict(self) -> dict:
        return {"weights": self.weights, "kv_peak": self.kv_peak, "activations": self.activations,
                "overhead": self.overhead, "need": self.need, "headroom": self.headroom, "quota": self.quota,
                "fixed": self.fixed, "sources": dict(self.sources)}


def compute_dtype(engine) -> str:
    """The dtype the engine will compute in: a config's `auto` is resolved for its device the way the
    engine resolves it at start, so a plan made before any engine exists sizes the same bytes."""
    return choose_dtype(engine.device)[0] if engine.dtype == "auto" else engine.dtype


def store_weights_bytes(store, name: str, dtype: str) -> int:
    """A stored model's weights in the compute dtype (its own parameters; a variant's delta only)."""
    return store.info(name).num_parameters * DTYPE_BYTES[dtype]


class _QuotaTerms:
    """One model's quota terms, each with where it came from (`sources`). A term that cannot be known is
    a UserError naming the setting to give, unless the model's quota is fixed (then it stays None)."""

    def __init__(self, name: str, m, engine, store, warnings: list[str]):
        self.name, self.m, self.engine, self.store, self.warnings = name, m, engine, store, warnings
        self.fixed = m.memory_quota_bytes is not None
        self.dtype = compute_dtype(engine)
        self.dtype_bytes = DTYPE_BYTES[self.dtype]
        self.sources: dict[str, str] = {}
        self._arch = None

    def arch(self):
        """The model's architecture, read from the store once (only when an estimate needs it)."""
        if self._arch is None:
            self._arch = load_arch((self.store or ModelStore()).base_dir(self.name))
        return self._arch

    def missing(self, term: str, key: str) -> None:
        if self.fixed:
            return None
        root = getattr(self.store, "root", None)
        where = f" {root}" if root else ""
        n = self.name
        raise UserError(f"sharing.models.{n}: model {n!r} is not in the store{where}, so its {term} is "
                        f"unknown; set sharing.models.{n}.{key} (or memory_quota_bytes), or pull/import the model")

    def weights(self) -> int | None:
        if self.m.weights_bytes is not None:
            self.sources["weights"] = "config"
            return self.m.weights_bytes
        try:
            weights = store_weights_bytes(self.store or ModelStore(), self.name, self.dtype)
        except ModelNotFound:
            return self.missing("weights size", "weights_bytes")
        self.sources["weights"] = f"store ({self.dtype})"
        return weights

    def kv_peak(self, weights: int | None) -> int | None:
        engine = self.engine
        if self.m.kv_peak_bytes is not None:
            self.sources["kv_peak"] = "config"
            return self.m.kv_peak_bytes
        if engine.kv_cache_bytes is not None:
            self.sources["kv_peak"] = "engine.kv_cache_bytes"
            return engine.kv_cache_bytes
        if weights is None:
            return None
        if engine.device_memory_bytes > weights:
            self.sources["kv_peak"] = "engine pool"
            return int((engine.device_memory_bytes - weights) * engine.kv_cache_fraction)
        try:
            a = self.arch()
        except ModelNotFound:
            return self.missing("KV peak", "kv_peak_bytes")
        self.sources["kv_peak"] = "estimate"
        self.warnings.append(
            f"{self.name}: engine.device_memory_bytes ({engine.device_memory_bytes / GB:.1f} GB) does not hold "
            f"its weights ({weights / GB:.1f} GB); KV peak estimated as max_num_seqs full contexts")
        return engine.scheduler.max_num_seqs * max_model_len(a, engine) * kv_bytes_per_token(a, self.dtype_bytes)

    def activations(self) -> int | None:
        if self.m.activation_bytes is not None:
            self.sources["activations"] = "config"
            return self.m.activation_bytes
        try:
            a = self.arch()
        except ModelNotFound:
            return self.missing("activation peak", "activation_bytes")
        s = self.engine.scheduler
        self.sources["activations"] = "estimate"
        return estimate_activation_bytes(a, self.dtype_bytes, s.max_num_batched_tokens, s.max_prefill_tokens,
                                         s.max_num_seqs, max_model_len(a, self.engine))

    def overhead(self, backend: str) -> int:
        if self.m.overhead_bytes is not None:
            self.sources["overhead"] = "config"
            return self.m.overhead_bytes
        self.sources["overhead"] = "default"
        return CUDA_OVERHEAD_BYTES if backend == "cuda" else 0


def memory_quota(name: str, sharing, *, backend: str = "cuda", engine=None, store=None,
                 warnings: list[str] | None = None) -> MemoryQuota:
    """The quota of one model (rules in the module docstring). A term that cannot be known (a model not
    in the store without weights_bytes) is a UserError saying what to set, unless the quota is fixed."""
    engine = engine or EngineConfig()
    m = sharing.model(name)
    warnings = warnings if warnings is not None else []
    terms = _QuotaTerms(name, m, engine, store, warnings)
    weights = terms.weights()
    kv = terms.kv_peak(weights)
    act = terms.activations()
    overhead = terms.overhead(backend)
    headroom = sharing.headroom
    q = MemoryQuota(name, weights, kv, act, overhead, headroom, quota=0, fixed=terms.fixed, sources=terms.sources)
    if terms.fixed:
        q.quota = m.memory_quota_bytes
        if q.need is not None and q.quota < q.need:
            warnings.append(f"{name}: memory_quota_bytes ({q.quota / GB:.1f} GB) is below its need "
                            f"({q.need / GB:.1f} GB); it will swap out under load")
    else:
        q.quota = int(math.ceil(q.need * (1 + headroom) - 1e-6))  # 25 GB x 1.2 is 30 GB, not 30 GB + 1 byte
    return q


# ---- the plan ---------------------------------------------------------------------------------

@dataclass
class Plan:
    """SM groups, spare SMs and memory quotas for a set of models on one device."""

    hardware: Hardware | None  # None: a CPU, no SMs to partition (quotas only)
    groups: list[Group]
    spare_sms: int
    quotas: dict[str, MemoryQuota]
    fits: dict[str, int]  # model -> how many models of its quota fit the device's memory
    memory_bytes: int | None  # the memory the quotas are checked against
    warnings: list[str] = field(default_factory=list)

    def group_of(self, model: str) -> Group | None:
        return next((g for g in self.groups if model in g.models), None)

    @property
    def quota_total(self) -> int:
        return sum(q.quota for q in self.quotas.values())

    @property
    def memory_fits(self) -> bool | None:
        return None if self.memory_bytes is None else self.quota_total <= self.memory_bytes

    def to_dict(self) -> dict:
        return {
            "hardware": self.hardware.to_dict() if self.hardware else None,
            "groups": [g.to_dict() for g in self.groups],
            "spare_sms": self.spare_sms,
            "quotas": {n: q.to_dict() for n, q in self.quotas.items()},
            "fits": dict(self.fits),
            "quota_total": self.quota_total,
            "memory_bytes": self.memory_bytes,
            "memory_fits": self.memory_fits,
            "warnings": list(self.warnings),
        }


def plan_groups(sharing, names: list[str]) -> list[tuple[str, list[str], float]]:
    """(group, its models, its share) in the order the groups first appear."""
    shares = sharing.shares(names)
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(sharing.group_of(n), []).append(n)
    return [(g, ms, min(1.0, sum(shares[m] for m in ms))) for g, ms in groups.items()]


def plan(sharing, hardware: Hardware | None, models: list[str] | None = None, *, engine=None, store=None,
         memory_bytes: int | None = None, with_quotas: bool = True) -> Plan:
    """The plan for `models` (default: the ones sharing.models lists) on `hardware`.

    hardware None = a CPU: no SM groups, quotas without the CUDA overhead, checked against
    `memory_bytes` (the device tier's budget) when given. Raises UserError when the groups cannot be
    partitioned (see allocate_sms) or a quota term cannot be known (see memory_quota).
    """
    sharing.validate()
    names = list(models) if models is not None else list(sharing.models)
    if len(set(names)) != len(names):
        raise UserError(f"a model is listed twice: {', '.join(names)}")
    warnings: list[str] = list(hardware.notes) if hardware else []
    groups: list[Group] = []
    spare = 0
    if hardware is not None:
        spec = plan_groups(sharing, names)
        alloc, notes = allocate_sms({g: s for g, _, s in spec}, hardware.num_sms, hardware.granularity)
        warnings += notes
        groups = [Group(g, ms, s, s * hardware.num_sms, alloc[g]) for g, ms, s in spec]
        spare = hardware.num_sms - sum(alloc.values())
    memory = hardware.memory_bytes if hardware is not None else memory_bytes
    quotas: dict[str, MemoryQuota] = {}
    fits: dict[str, int] = {}
    if with_quotas:
        backend = "cuda" if hardware is not None else "cpu"
        for n in names:
            quotas[n] = memory_quota(n, sharing, backend=backend, engine=engine, store=store, warnings=warnings)
            if memory is not None and quotas[n].quota > 0:
                fits[n] = memory // quotas[n].quota
        if memory is not None:
            for n, q in quotas.items():
                if q.quota > memory:
                    warnings.append(f"{n}: its quota ({q.quota / GB:.1f} GB) is more than the device's memory "
                                    f"({memory / GB:.1f} GB); it cannot be resident")
            total = sum(q.quota for q in quotas.values())
            if total > memory:
                warnings.append(f"the quotas add up to {total / GB:.1f} GB, more than the device's "
                                f"{memory / GB:.1f} GB: not every model can be resident at once; the rest wait in "
                                "the host tier (swap-out)")
    return Plan(hardware, groups, spare, quotas, fits, memory, warnings)
