"""The batch-1 decode floor: how fast a decode step could possibly be on this machine.

At batch 1 a decode step must read every weight once (every linear layer and
the LM head), and on a CPU that read is limited by memory bandwidth, so
`weight bytes per step / read bandwidth` is a lower bound on the step time.
The benchmark reports gpuserv's measured batch-1 step next to it (issue 2 asks
for <= 1.5x the floor).

torch is imported inside the functions: the report and the CLI import this
module without paying for torch.
"""

from __future__ import annotations

import os
import time

# torch is imported inside measure_read_bandwidth: reports import this module without it (test_bench_report.py).
GIB = 1 << 30


def measure_read_bandwidth(num_threads: int, nbytes: int = GIB, repeats: int = 3) -> float:
    """Read-only memory bandwidth in bytes/s: `sum()` over an `nbytes` fp32 tensor with
    `num_threads` torch threads, best of `repeats` after one warm-up pass.

    1 GiB is far beyond any CPU cache, so the sum streams from DRAM; the thread
    count is restored afterwards."""
    import torch  # here: reports import this module without torch (the note above)

    before = torch.get_num_threads()
    torch.set_num_threads(int(num_threads))
    x = None
    try:
        # Distinct values on every page: empty() leaves pages unmapped and a constant fill
        # (ones()) lets a hypervisor or KSM merge identical pages into one cached page,
        # which read here as 63 GB/s on a machine whose DRAM gives ~20-30.
        x = torch.arange(nbytes // 4, dtype=torch.float32)
        x.sum()  # warm-up: thread pool start, page-table walk
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t)
        return x.numel() * 4 / best
    finally:
        del x
        torch.set_num_threads(before)


def decode_params(config: dict, biases: bool = True) -> tuple[int, int]:
    """(weights of the decoder layers' linear maps, weights of the LM head) of a Llama-family config.json:
    every linear layer (q, k, v, o, gate, up, down; q/k/v biases where `attention_bias`, unless not
    `biases`: a count of multiply-adds leaves them out) and the LM head (the embedding matrix when tied;
    the same size either way). The embedding lookup (one row) and the norm vectors are left out: they
    are a rounding error."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inter = int(config["intermediate_size"])
    layers = int(config["num_hidden_layers"])
    vocab = int(config["vocab_size"])

    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    # Qwen2 has q/k/v biases; Llama's attention_bias adds them too (and an o bias).
    if biases and (config.get("attention_bias") or config.get("model_type") == "qwen2"):
        attention += q + 2 * kv + (hidden if config.get("attention_bias") else 0)
    mlp = 3 * hidden * inter + (2 * inter + hidden if biases and config.get("mlp_bias") else 0)
    return layers * (attention + mlp), vocab * hidden


def weight_bytes_per_decode_step(config: dict, dtype_bytes: int) -> int:
    """Bytes of weights one batch-1 decode step must read (decode_params at `dtype_bytes` a weight)."""
    return sum(decode_params(config)) * int(dtype_bytes)


def held_weight_bytes(weights, num_layers: int) -> int:
    """Bytes of the linear layers and LM head as an engine holds them (runner/model_weights.py): a
    batch-1 step reads each once. Less than the checkpoint's dtype gives where weights are held in fewer
    bytes with the same values (bf16 or 4-bit panels of exactly such fp32 weights, runner/linear.py): the
    floor of that engine is its own bytes, not the checkpoint's."""
    return sum(getattr(weights.layer(i), name).nbytes for i in range(num_layers)
               for name in ("qkv", "o_proj", "gate_up", "down")) + weights.lm_head.nbytes


def decode_floor_s(weight_bytes_per_step: int, bandwidth: float) -> float:
    """The lower bound on a batch-1 decode step, seconds: weight bytes / read bandwidth."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    return weight_bytes_per_step / bandwidth


PROBE_RUNS = 3  # separate probes (fresh 1 GiB each): where the tensor lands in memory changes the reading


def best_bandwidth(num_threads: int, probe=measure_read_bandwidth, runs: int = PROBE_RUNS,
                   earlier: tuple[float, ...] = ()) -> tuple[float, list[float]]:
    """The highest of `runs` probes with the engine's thread count, and of any `earlier` readings.

    A floor is weight bytes / bandwidth, so the highest bandwidth read gives the lowest (safest) floor:
    a probe can only under-read what the memory can do (a neighbour, a cold page table, a bad placement),
    never over-read it. Returns (best, every reading)."""
    readings = [float(x) for x in earlier] + [float(probe(num_threads)) for _ in range(runs)]
    if not readings or max(readings) <= 0:
        raise ValueError(f"no positive bandwidth reading: {readings}")
    return max(readings), readings


def floor_summary(weight_bytes: int, bandwidth: float, gpuserv_batch1_step_s: float | None = None,
                  readings: list[float] | None = None, checkpoint_weight_bytes: int | None = None) -> dict:
    """The report's `floor` section. gpuserv's measured batch-1 step may be filled in later
    (`ratio` = measured / floor; None until then). checkpoint_weight_bytes: the same weights at the
    dtype (what a peer with dense weights reads), where gpuserv holds them in fewer bytes.

    A floor is a lower bound. When the measured step beats it, the probe under-read the bandwidth: the
    section says so (`probe_wrong`, with the bandwidth the step itself implies) and `ratio` stays None,
    because a ratio under 1 would claim the impossible."""
    floor_s = decode_floor_s(weight_bytes, bandwidth)
    step_ms = None if gpuserv_batch1_step_s is None else 1000.0 * gpuserv_batch1_step_s
    ratio = None if step_ms is None else step_ms / (1000.0 * floor_s)
    out = {
        "weight_bytes": int(weight_bytes),
        "read_bandwidth_gbs": bandwidth / 1e9,
        "probe_readings_gbs": [round(x / 1e9, 2) for x in readings or [bandwidth]],
        "floor_step_ms": 1000.0 * floor_s,
        "gpuserv_batch1_step_ms": step_ms,
        "ratio": ratio,
        "probe_wrong": False,
    }
    if checkpoint_weight_bytes is not None:
        out["checkpoint_weight_bytes"] = int(checkpoint_weight_bytes)
    if ratio is not None and ratio < 1.0:
        implied = weight_bytes / gpuserv_batch1_step_s
        out.update(ratio=None, probe_wrong=True, step_implied_bandwidth_gbs=implied / 1e9,
                   note=f"the measured step ({step_ms:.1f} ms) beat the floor ({1000 * floor_s:.1f} ms): the "
                        f"bandwidth probe was wrong (best of {len(out['probe_readings_gbs'])} reads "
                        f"{bandwidth / 1e9:.1f} GB/s; the step itself read at least {implied / 1e9:.1f} GB/s), "
                        "so this floor is not a lower bound and no ratio is given")
    return out


class ForeignLoad:
    """How much CPU other processes used while a measurement ran: a context manager.

    On a small shared machine one busy neighbour halves a 2-thread run (an
    OpenMP step waits for its descheduled thread), so every timing should say
    how quiet the machine was. `share` is the foreign CPU time over the
    machine's capacity during the block (0 = quiet, 0.5 = one of 2 cores taken);
    None where /proc/stat is missing (not Linux)."""

    def __init__(self):
        self.foreign_cpu_s: float | None = None  # CPU seconds used by other processes during the block
        self.share: float | None = None  # foreign_cpu_s / (wall seconds x cores)

    @staticmethod
    def _busy_s() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> ForeignLoad:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> ForeignLoad:
        """Begin counting (what `with` does on entry)."""
        self._wall, self._own, self._busy = time.perf_counter(), time.process_time(), self._busy_s()
        return self

    def stop(self) -> None:
        """Stop counting and fill in `foreign_cpu_s` and `share`."""
        busy = self._busy_s()
        if busy is None or self._busy is None:
            return
        wall = time.perf_counter() - self._wall
        self.foreign_cpu_s = max(0.0, (busy - self._busy) - (time.process_time() - self._own))
        self.share = self.foreign_cpu_s / max(wall * (os.cpu_count() or 1), 1e-9)
