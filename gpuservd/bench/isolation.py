"""`gpuserv bench isolation`: two models on one device: isolation judged on the small
model's P99 (never the mean), with time slices and bandwidth priority.

A small latency-critical model under steady Poisson load and a larger
best-effort model under heavy closed-loop load, on the same device, each on its
own engine thread exactly as the daemon runs them (EngineLoop, the same
engines, the same arbiter). Phases, each `duration_s` long, on the same two
engines:

  small-alone       the small model alone: its reference step and request P99
  big-alone         the big model alone: its reference throughput
  naive             both, no arbiter: each steps whenever it has work
  gpuserv           both, the arbiter: time slices + latency-critical priority + AIMD
  gpuserv-concurrent  both, the arbiter with the models in separate groups (no time slices):
                    bandwidth priority alone (what protects a model in its own SM partition)

Then the time-slice overhead: both models saturated and best effort with
equal shares, at quanta 10, 20 and 50 ms; reported as the arbiter's own
switching share (handoff time / time) and end to end (1 - the sum of each
model's throughput as a fraction of its saturated solo throughput).

Step latency is what the small model's callers see between two tokens (the
arbiter's wait included); request latency is arrival to last token.
"""

from __future__ import annotations

import asyncio
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from gpuservd.bench.floor import ForeignLoad
from gpuservd.bench.output import write_result
from gpuservd.bench.random_model import RANDOM_MODELS, ensure_random_llama
from gpuservd.bench.report import percentiles
from gpuservd.config import EngineConfig
from gpuservd.dtypes import choose_dtype
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.engine.loop import AnyEngineLoop, EngineLoop, Failed, Submission
from gpuservd.events.types import BandwidthThrottle, Event, StepRecord
from gpuservd.gpu.readings import DeviceReader, PhaseSampler
from gpuservd.sharing.arbiter import Arbiter
from gpuservd.sharing.config import SharingClass, SharingConfig
from gpuservd.store.store import ModelStore

WARM_FRACTION = 0.25  # throughput is counted after the first quarter of a phase (past the initial prefills)
PHASES = ("small-alone", "big-alone", "naive", "gpuserv", "gpuserv-concurrent")
SMALL_P99_LIMIT = 1.5  # gpuserv keeps the small model's P99 within this of its solo P99 (the issue)
BIG_TPUT_FLOOR = 0.6  # while the big model keeps this share of its solo throughput
OVERHEAD_LIMIT = 0.05  # time-slice switching at 20 ms quanta (the seed: 3-5%)


@dataclass
class IsolationSpec:
    small: str = "smollm2"
    big: str = "isolation-big"  # made in the store (random weights, ~476M parameters) when missing
    device: str = "cpu"
    dtype: str = "auto"  # auto: the device's best (gpuservd/dtypes.py), resolved when the spec is made
    duration_s: float = 30.0
    # The small model is a classifier-like service (the seed's 1.3B classifier): a short answer to a
    # prompt, one request a second. On 2 CPU cores SmolLM2 is busy ~30% of the time with it, which caps
    # what the big model can have at ~70% of the device (reported as small_busy_share).
    small_rate: float = 1.0  # requests/s, Poisson
    small_prompt: int = 48
    small_output: int = 4
    big_concurrency: int = 8
    big_prompt: int = 32
    big_output: int = 128  # the mean: each request draws 64-192
    quanta: list = field(default_factory=lambda: [10, 20, 50])
    overhead_s: float = 15.0
    small_share: float = 0.6
    seed: int = 0
    phases: list | None = None  # a subset of PHASES (None = all); ratios need small-alone and big-alone
    overhead: bool = True  # measure the time-slice overhead too

    def __post_init__(self):
        if self.dtype == "auto":
            self.dtype = choose_dtype(self.device)[0]


class _Track:
    """A request's sink: the event loop thread records when each token arrives."""

    def __init__(self, rid: str, arrival: float, done):
        self.rid, self.arrival, self.done = rid, arrival, done
        self.token_times: list[float] = []
        self.finished_at: float | None = None
        self.error = None

    def put(self, item) -> None:
        if isinstance(item, Failed):
            self.error = item.error
            self.finished_at = time.perf_counter()
            self.done(self)
            return
        tokens = getattr(item, "new_token_ids", None)
        if tokens is None:
            return  # Accepted
        now = time.perf_counter()
        self.token_times += [now] * len(tokens)
        if item.finished:
            self.finished_at = now
            self.done(self)


class _Driver:
    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop = aloop
        self.loops: dict[str, AnyEngineLoop] = {}  # model -> its engine loop
        self.events: list[Event] = []  # everything the engine loops published
        self._n = 0
        self.reader = None  # gpu.readings.DeviceReader of the device the phases run on

    def on_post(self, deliveries: list, events: list) -> None:
        for sink, item in deliveries:
            sink.put(item)
        self.events.extend(events)

    def submit(self, model: str, prompt: list[int], max_tokens: int, done) -> _Track:
        self._n += 1
        rid = f"{model}-{self._n}"
        t = _Track(rid, time.perf_counter(), done)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        self.loops[model].submit(Submission(rid, prompt, params, t))
        return t


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 20000) for _ in range(n)]


def _engine_config(spec: IsolationSpec, model: str, big: bool):
    cfg = EngineConfig(model=model, device=spec.device, dtype=spec.dtype, kv_cache_bytes=512 << 20)
    if big:
        # The best-effort model prefills at most one prompt's worth a step: shorter layers, so the
        # latency-critical model waits less at a layer boundary (an operator's setting, same in every phase).
        cfg.scheduler.max_prefill_tokens = max(spec.big_prompt, 32)
    return cfg


async def _run_phase(drv: _Driver, spec: IsolationSpec, small_on: bool, big_on: bool, duration: float,
                     small_closed: int = 0) -> dict:
    """Drive the phase's load for `duration`; returns raw timings."""
    # Separate streams, so every phase sees the same small-model arrivals and prompts whatever the big
    # model does (one shared stream let the big model's prompts shift the small model's arrivals).
    arrivals, small_rng, big_rng = (random.Random(f"{spec.seed}-{k}") for k in ("arrivals", "small", "big"))
    t0 = time.perf_counter()
    end = t0 + duration
    small_tracks: list[_Track] = []
    big_tracks: list[_Track] = []
    big_tokens: list[float] = []
    small_tokens: list[float] = []
    pending: set = set()
    loop = asyncio.get_running_loop()

    def closed_loop(model: str, rng: random.Random, prompt_len: int, lengths: tuple[int, int],
                    tracks: list, tokens: list):
        """start(): one request of the loop; each one that finishes before `end` starts the next. Output
        lengths vary (lengths = lo, hi) so the loop does not settle into waves of requests that start and
        finish together (a window's count would then depend on its phase)."""
        def done(t: _Track) -> None:
            pending.discard(t)
            tokens.extend(x for x in t.token_times if x <= end)
            if time.perf_counter() < end and t.error is None:
                loop.call_soon(start)

        def start() -> None:
            t = drv.submit(model, _prompt(rng, prompt_len), rng.randint(*lengths), done)
            tracks.append(t)
            pending.add(t)

        return start

    start_big = closed_loop(spec.big, big_rng, spec.big_prompt, (spec.big_output // 2, spec.big_output * 3 // 2),
                            big_tracks, big_tokens)
    start_small_closed = closed_loop(spec.small, small_rng, spec.small_prompt,
                                     (max(1, spec.small_output // 2), spec.small_output * 3 // 2 + 1),
                                     small_tracks, small_tokens)

    def small_done(t: _Track) -> None:
        pending.discard(t)

    if big_on:
        for _ in range(spec.big_concurrency):
            start_big()
    if small_on and small_closed:
        for _ in range(small_closed):
            start_small_closed()
    load = ForeignLoad().start()
    sampler = PhaseSampler(drv.reader).start() if drv.reader is not None else None
    if small_on and not small_closed:
        next_at = t0 + arrivals.expovariate(spec.small_rate)
        while next_at < end:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            t = drv.submit(spec.small, _prompt(small_rng, spec.small_prompt), spec.small_output, small_done)
            small_tracks.append(t)
            pending.add(t)
            next_at += arrivals.expovariate(spec.small_rate)
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    load.stop()
    if sampler is not None:
        sampler.stop()
    # Poisson requests already sent finish (their latency counts); closed-loop ones are cut at `end`.
    for t in list(pending):
        if t in big_tracks or (small_closed and t in small_tracks):
            drv.loops[spec.big if t in big_tracks else spec.small].abort(t.rid)
    deadline = time.perf_counter() + 120
    while pending and time.perf_counter() < deadline:
        await asyncio.sleep(0.02)
    for t in big_tracks:
        if t.finished_at is None or t.error is not None:
            big_tokens.extend(x for x in t.token_times if x <= end)
    if small_closed:
        for t in small_tracks:
            if t.finished_at is None or t.error is not None:
                small_tokens.extend(x for x in t.token_times if x <= end)
    return {"t0": t0, "end": end, "small": small_tracks, "big_tokens": big_tokens, "small_tokens": small_tokens,
            "foreign_cpu_share": load.share, "device": None if sampler is None else sampler.summary()}


def _ms(d: dict | None) -> dict | None:
    return {k: round(1000 * v, 2) for k, v in d.items()} if d else None


def _summarise(raw: dict, spec: IsolationSpec, duration: float) -> dict:
    done = [t for t in raw["small"] if t.finished_at is not None and t.error is None
            and len(t.token_times) == spec.small_output]
    gaps = [b - a for t in done for a, b in zip(t.token_times, t.token_times[1:])]
    out = {"foreign_cpu_share": raw["foreign_cpu_share"]}
    if raw.get("device") is not None:  # clocks and load the phase ran at (medians of 0.5 s readings)
        out["device"] = raw["device"]
    if raw["small"] and not raw["small_tokens"]:
        out["small"] = {
            "num_requests": len(raw["small"]), "num_completed": len(done),
            "request_ms": _ms(percentiles([t.finished_at - t.arrival for t in done])),
            "ttft_ms": _ms(percentiles([t.token_times[0] - t.arrival for t in done])),
            "step_ms": _ms(percentiles(gaps)),
        }
    start = raw["t0"] + WARM_FRACTION * duration
    window = raw["end"] - start
    if raw["small_tokens"]:
        out["small_tokens_per_s"] = round(sum(1 for x in raw["small_tokens"] if x >= start) / window, 3)
    if raw["big_tokens"]:
        out["big_tokens_per_s"] = round(sum(1 for x in raw["big_tokens"] if x >= start) / window, 3)
    return out


async def _set_arbiter(drv: _Driver, spec: IsolationSpec, mode: str | None, quantum_ms: float = 20,
                       shares: tuple[float, float] | None = None):
    """mode None: no arbiter; "slice": one time-sliced group; "concurrent": a group per model."""
    if mode is None:
        for lp in drv.loops.values():
            await asyncio.wrap_future(lp.set_arbiter(None))
        return None
    arb = Arbiter(SharingConfig(quantum_ms=quantum_ms), device=spec.device)
    if shares is None:  # the isolation setting: small latency critical
        classes = {spec.small: (spec.small_share, SharingClass.LATENCY_CRITICAL),
                   spec.big: (1 - spec.small_share, SharingClass.BEST_EFFORT)}
    else:
        classes = {spec.small: (shares[0], SharingClass.BEST_EFFORT), spec.big: (shares[1], SharingClass.BEST_EFFORT)}
    for name, lp in drv.loops.items():
        share, cls = classes[name]
        group = "device" if mode == "slice" else name
        await asyncio.wrap_future(lp.set_arbiter(arb.register(name, group, share, cls)))
    return arb


async def _main(spec: IsolationSpec, log) -> dict:
    aloop = asyncio.get_running_loop()
    drv = _Driver(aloop)
    if spec.device.startswith("cuda"):  # the SM clock and load of each phase (a CPU has no such reading)
        drv.reader = DeviceReader(spec.device)
    store = ModelStore()
    for name in (spec.small, spec.big):
        info = store.check(name)
        cfg = _engine_config(spec, name, big=name == spec.big)
        lp = EngineLoop(name, lambda p=info.path, c=cfg, n=name: LLMEngine(n, p, c), aloop, drv.on_post)
        lp.start()
        await asyncio.wrap_future(lp.ready)
        drv.loops[name] = lp
        log(f"{name}: engine ready on {spec.device}")
    # warm-up: first-call costs (allocator, kernels) stay out of every phase
    await _run_phase(drv, spec, True, True, 3.0)
    drv.events.clear()
    phases: dict[str, dict] = {}
    arbiters: dict[str, dict] = {}
    plan = {"small-alone": (True, False, None), "big-alone": (False, True, None), "naive": (True, True, None),
            "gpuserv": (True, True, "slice"), "gpuserv-concurrent": (True, True, "concurrent")}
    for name, (small_on, big_on, mode) in plan.items():
        if spec.phases is not None and name not in spec.phases:
            continue
        arb = await _set_arbiter(drv, spec, mode)
        log(f"phase {name} ({spec.duration_s:.0f} s)")
        raw = await _run_phase(drv, spec, small_on, big_on, spec.duration_s)
        phases[name] = _summarise(raw, spec, spec.duration_s)
        phases[name]["engine_steps"] = _engine_steps(drv.events, spec.duration_s)
        if arb is not None:
            arbiters[name] = arb.status()
            phases[name]["throttle_events"] = sum(1 for e in drv.events if isinstance(e, BandwidthThrottle))
        drv.events.clear()
        log(f"  {phases[name]}")
    slices: dict = {}
    solo_small, solo_big = {"foreign_cpu_share": None}, {"foreign_cpu_share": None}
    if spec.overhead:
        solo_small, solo_big, slices = await _overhead(drv, spec, log)
    await _set_arbiter(drv, spec, None)
    for lp in drv.loops.values():
        lp.stop()
    return {"phases": phases, "arbiter": arbiters, "time_slices": slices,
            "saturated_solo": {"small_tokens_per_s": solo_small.get("small_tokens_per_s"),
                               "big_tokens_per_s": solo_big.get("big_tokens_per_s"),
                               "foreign_cpu_share": [solo_small["foreign_cpu_share"], solo_big["foreign_cpu_share"]]}}


def _engine_steps(events: list[Event], duration: float) -> dict:
    """Each model's engine step time in a phase (forward + sampling; waits for the grant before the step
    are outside it, yields inside it are in): P50/P99 ms split by whether the step carried prefill, and
    busy_share, the step time over the phase's length (for the small model alone: the device share it needs)."""
    out: dict = {}
    for e in events:
        if not isinstance(e, StepRecord):
            continue
        kind = "prefill" if e.num_prefill_tokens else "decode"
        out.setdefault(e.model, {}).setdefault(kind, []).append(e.wall_s)
    return {m: {**{k: {"n": len(v), **(_ms(percentiles(v)) or {})} for k, v in kinds.items()},
                "busy_share": round(sum(sum(v) for v in kinds.values()) / duration, 4)}
            for m, kinds in out.items()}


async def _overhead(drv: _Driver, spec: IsolationSpec, log):
    """Time-slice overhead: both saturated, best effort, equal shares."""
    await _set_arbiter(drv, spec, None)
    log(f"phase small-saturated ({spec.overhead_s:.0f} s)")
    solo_small = _summarise(await _run_phase(drv, spec, True, False, spec.overhead_s, small_closed=4),
                            spec, spec.overhead_s)
    solo_small["engine_steps"] = _engine_steps(drv.events, spec.overhead_s)
    drv.events.clear()
    log(f"phase big-saturated ({spec.overhead_s:.0f} s)")
    solo_big = _summarise(await _run_phase(drv, spec, False, True, spec.overhead_s), spec, spec.overhead_s)
    solo_big["engine_steps"] = _engine_steps(drv.events, spec.overhead_s)
    drv.events.clear()
    slices = {}
    for q in spec.quanta:
        arb = await _set_arbiter(drv, spec, "slice", quantum_ms=q, shares=(0.5, 0.5))
        log(f"phase time-slice {q} ms ({spec.overhead_s:.0f} s)")
        s = _summarise(await _run_phase(drv, spec, True, True, spec.overhead_s, small_closed=4), spec, spec.overhead_s)
        st = arb.status()
        frac_small = s.get("small_tokens_per_s", 0) / max(solo_small.get("small_tokens_per_s", 1e-9), 1e-9)
        frac_big = s.get("big_tokens_per_s", 0) / max(solo_big.get("big_tokens_per_s", 1e-9), 1e-9)
        run_s = {m: v["run_s"] for m, v in st["models"].items()}
        slices[str(q)] = {
            "quantum_ms": q, "switch_share": st["overhead_share"], "num_switches": st["num_switches"],
            "switch_ms_mean": round(1000 * st["switch_s"] / st["num_switches"], 4) if st["num_switches"] else None,
            "slice_ms_mean": round(1000 * sum(run_s.values()) / max(1, sum(v["num_slices"] for v in st["models"].values())), 3),
            "run_s": run_s, "small_fraction_of_solo": round(frac_small, 4), "big_fraction_of_solo": round(frac_big, 4),
            "end_to_end_loss": round(1 - frac_small - frac_big, 4), "foreign_cpu_share": s["foreign_cpu_share"],
        }
        slices[str(q)]["engine_steps"] = _engine_steps(drv.events, spec.overhead_s)
        drv.events.clear()
        log(f"  {slices[str(q)]}")
    return solo_small, solo_big, slices


def run_isolation(spec: IsolationSpec, out_dir: Path, log=print) -> dict:
    store = ModelStore()
    for name in (spec.small, spec.big):  # the benchmark's own random models are made on first use
        if name in RANDOM_MODELS:
            ensure_random_llama(store, name, RANDOM_MODELS[name], tokenizer_from="smollm2")
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    body = asyncio.run(_main(spec, log))
    ph = body["phases"]

    def p99(name):
        return ((ph.get(name) or {}).get("small") or {}).get("request_ms", {}).get("p99")

    def step99(name):
        return ((ph.get(name) or {}).get("small") or {}).get("step_ms", {}).get("p99")

    solo_tput = (ph.get("big-alone") or {}).get("big_tokens_per_s") or 0
    summary = {}
    for name in ("naive", "gpuserv", "gpuserv-concurrent"):
        if name not in ph:
            summary[name] = {"small_request_p99_vs_solo": None, "small_step_p99_vs_solo": None,
                             "big_throughput_vs_solo": None}
            continue
        summary[name] = {
            "small_request_p99_vs_solo": round(p99(name) / p99("small-alone"), 3) if p99(name) and p99("small-alone") else None,
            "small_step_p99_vs_solo": round(step99(name) / step99("small-alone"), 3) if step99(name) and step99("small-alone") else None,
            "big_throughput_vs_solo": round((ph[name].get("big_tokens_per_s") or 0) / solo_tput, 3) if solo_tput else None,
        }
    g = summary["gpuserv"]
    q20 = body["time_slices"].get("20", {})
    summary["targets"] = {
        "small_p99_within_1_5x_solo": g["small_request_p99_vs_solo"] is not None and g["small_request_p99_vs_solo"] <= SMALL_P99_LIMIT,
        "big_keeps_60pct": g["big_throughput_vs_solo"] is not None and g["big_throughput_vs_solo"] >= BIG_TPUT_FLOOR,
        "switch_overhead_20ms_le_5pct": q20.get("switch_share") is not None and q20["switch_share"] <= OVERHEAD_LIMIT,
    }
    result = {"scenario": "isolation", "started": started, "spec": asdict(spec),
              "machine": {"platform": platform.platform(), "device": spec.device, "torch": torch.__version__,
                          "num_threads": torch.get_num_threads(),
                          "cuda_device": torch.cuda.get_device_name(0) if spec.device.startswith("cuda") else None},
              **body, "summary": summary}
    out = write_result(out_dir, result, markdown(result))
    try:
        plot(out / "small-latency-cdf.png", result)
    except Exception as exc:  # a plot is a convenience; the numbers are in result.json
        log(f"plot skipped: {exc}")
    log(f"wrote {out}")
    return result


def markdown(r: dict) -> str:
    ph, s = r["phases"], r["summary"]
    spec = r["spec"]
    lines = [f"# Isolation: {spec['small']} (latency critical) + {spec['big']} (best effort) on {spec['device']}", "",
             f"small: Poisson {spec['small_rate']}/s, {spec['small_prompt']} -> {spec['small_output']} tokens; "
             f"big: {spec['big_concurrency']} in flight, {spec['big_prompt']} -> {spec['big_output'] // 2}-"
             f"{spec['big_output'] * 3 // 2} tokens; "
             f"{spec['duration_s']:.0f} s a phase.", "",
             "| phase | small step P50 / P99 ms | small request P50 / P99 ms | big tokens/s | foreign CPU | "
             "SM clock MHz / util % |", "|---|---|---|---|---|---|"]
    for name in PHASES:
        p = ph.get(name) or {}
        sm = p.get("small") or {}
        st, rq = sm.get("step_ms") or {}, sm.get("request_ms") or {}
        step = f"{st.get('p50', '-')} / {st.get('p99', '-')}" if st else "-"
        req = f"{rq.get('p50', '-')} / {rq.get('p99', '-')}" if rq else "-"
        fc = p.get("foreign_cpu_share")
        dev = p.get("device") or {}
        clock = "-" if dev.get("sm_clock_mhz") is None else f"{dev['sm_clock_mhz']} / {dev.get('sm_util_pct', '-')}"
        lines.append(f"| {name} | {step} | {req} | {p.get('big_tokens_per_s', '-')} | "
                     f"{'-' if fc is None else f'{100 * fc:.0f}%'} | {clock} |")
    lines += ["", "| vs solo | small request P99 | small step P99 | big throughput |", "|---|---|---|---|"]
    for name in ("naive", "gpuserv", "gpuserv-concurrent"):
        x = s[name]
        lines.append(f"| {name} | {x['small_request_p99_vs_solo']}x | {x['small_step_p99_vs_solo']}x | "
                     f"{x['big_throughput_vs_solo']}x |")
    lines += ["", "Time slices (both models saturated, best effort, equal shares):", "",
              "| quantum | switch share (arbiter) | mean switch ms | mean slice ms | end-to-end loss |", "|---|---|---|---|---|"]
    for q, x in r["time_slices"].items():
        lines.append(f"| {q} ms | {100 * x['switch_share']:.2f}% | {x['switch_ms_mean']} | {x['slice_ms_mean']} | "
                     f"{100 * x['end_to_end_loss']:.1f}% |")
    t = s["targets"]
    lines += ["", f"Targets: small P99 <= 1.5x solo: {'met' if t['small_p99_within_1_5x_solo'] else 'NOT met'}; "
              f"big >= 60% of solo: {'met' if t['big_keeps_60pct'] else 'NOT met'}; "
              f"switching <= 5% at 20 ms: {'met' if t['switch_overhead_20ms_le_5pct'] else 'NOT met'}.", ""]
    return "\n".join(lines)


def plot(path: Path, r: dict) -> None:
    """CDF of the small model's request latency in each phase: the tail is the point."""
    import matplotlib  # only when a plot is drawn: importing it takes about a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot fixes its backend when imported

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("small-alone", "naive", "gpuserv", "gpuserv-concurrent"):
        sm = (r["phases"].get(name) or {}).get("small") or {}
        rq = sm.get("request_ms")
        if rq:
            ax.plot([rq["p50"], rq["p90"], rq["p99"]], [50, 90, 99], marker="o", label=name)
    ax.set_xlabel("small model request latency (ms)")
    ax.set_ylabel("percentile")
    ax.set_title("Latency-critical model under co-location")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
