"""packed_gemm.cpp as it was at 9a2318d, rewritten as op gpx::packed_linear(..., mode) for the A/Bs of
layout_prefetch_ab.py: bit 0 drops the software prefetch of the next panel group, bit 1 reads W with a
group's 3 panels interleaved per pair step (one sequential stream), bit 2 takes six panels a call at 1-2
rows (six independent accumulator chains). Written from the pinned source at run time, so the record holds
only the changes."""
import subprocess
from pathlib import Path

REV = "9a2318d"
CSRC = "gpuservd/runner/csrc"
EDITS = [
    ("const __m512i* pf, int64_t pf_lines) {\n  __m512 acc[MR][NV];",
     "const __m512i* pf, int64_t pf_lines, int64_t vs, int64_t ks) {\n  __m512 acc[MR][NV];"),
    ("w[v] = _mm512_loadu_si512(wp + v * K2 + kk);", "w[v] = _mm512_loadu_si512(wp + v * vs + kk * ks);"),
    ("uint16_t* y, float* yf, int64_t ldy, int64_t ncols, const __m512i* pf, int64_t pf_lines) {\n  // Blocks",
     "uint16_t* y, float* yf, int64_t ldy, int64_t ncols, const __m512i* pf, int64_t pf_lines, int64_t vs, int64_t ks) {\n  // Blocks"),
    ("next_pf(), lines());", "next_pf(), lines(), vs, ks);"),
    ("ncols, p, n); break;", "ncols, p, n, vs, ks); break;"),
    ("const uint16_t* bias, uint16_t* y, float* yf, int64_t N) {\n  constexpr int64_t NV = 3;",
     "const uint16_t* bias, uint16_t* y, float* yf, int64_t N, int mode) {\n  constexpr int64_t NV = 3;"),
    ("const __m512i* pf = (m0 == 0 && next > 0) ? w + (p + NV) * K2 : nullptr;",
     "const __m512i* pf = (m0 == 0 && next > 0 && (mode & 1) == 0) ? w + (p + NV) * K2 : nullptr;\n"
     "      const int64_t vs = (mode & 2) ? 1 : K2, ks = (mode & 2) ? nv : 1;"),
    ("      if (nv == 3) rows_nv<3>(rows, xc, ldx2, wp, K2, bp, yp, yfp, N, ncols, pf, pf_lines);",
     "      if ((mode & 4) && rows <= 2 && p + 6 <= p1) {\n"
     "        const int64_t nc6 = std::min(N - p * kPanel, 6 * kPanel);\n"
     "        if (rows == 1) micro<1, 6>(xc, ldx2, wp, K2, bp, yp, yfp, N, nc6, nullptr, 0, K2, 1);\n"
     "        else micro<2, 6>(xc, ldx2, wp, K2, bp, yp, yfp, N, nc6, nullptr, 0, K2, 1);\n"
     "        p += 3;  // with the loop's += NV: six panels\n"
     "        continue;\n"
     "      }\n"
     "      if (nv == 3) rows_nv<3>(rows, xc, ldx2, wp, K2, bp, yp, yfp, N, ncols, pf, pf_lines);"),
    ("ncols, pf, pf_lines);", "ncols, pf, pf_lines, vs, ks);"),
    ("const std::optional<at::Tensor>& bias, bool fp32_out, const at::Tensor* into) {",
     "const std::optional<at::Tensor>& bias, bool fp32_out, const at::Tensor* into, int mode = 0) {"),
    ("panels(g0 * 3, std::min(P, g1 * 3), M, xp, ldx2, wp, K2, bp, yp, yfp, N);",
     "panels(g0 * 3, std::min(P, g1 * 3), M, xp, ldx2, wp, K2, bp, yp, yfp, N, mode);"),
    ("const std::optional<at::Tensor>& bias, bool fp32_out) {\n  return packed_linear_into(x, packed, N, bias, fp32_out, nullptr);",
     "const std::optional<at::Tensor>& bias, bool fp32_out, int64_t mode) {\n"
     "  return packed_linear_into(x, packed, N, bias, fp32_out, nullptr, (int)mode);"),
    ('packed_linear(Tensor x, Tensor packed, int n, Tensor? bias, bool fp32_out=False) -> Tensor',
     'packed_linear(Tensor x, Tensor packed, int n, Tensor? bias, bool fp32_out, int mode) -> Tensor'),
    ("TORCH_LIBRARY_FRAGMENT(gpuserv,", "TORCH_LIBRARY_FRAGMENT(gpx,"),
    ("TORCH_LIBRARY_IMPL(gpuserv,", "TORCH_LIBRARY_IMPL(gpx,"),
]


def write(root: Path, build: Path) -> Path:
    """The variant and the header it includes, under `build`; returns the .cpp."""
    def show(name: str) -> str:
        return subprocess.run(["git", "-C", str(root), "show", f"{REV}:{CSRC}/{name}"], check=True,
                              capture_output=True, text=True).stdout
    src = show("packed_gemm.cpp")
    for old, new in EDITS:
        if old not in src:
            raise SystemExit(f"packed_gemm.cpp at {REV} has no {old[:60]!r}")
        src = src.replace(old, new)
    build.mkdir(parents=True, exist_ok=True)
    (build / "simd.h").write_text(show("simd.h"))
    (build / "pg.cpp").write_text(src)
    return build / "pg.cpp"
