"""Published kernel tables, row by row, each with the repository, file, commit and table it came from.

The built-in GPU entries' efficiency curves, kernel floors and all-to-all fits are *computed* from
these rows (``kernel_fits``); the rows a fit does not use are held out and priced against the planner
in the validation table (``validation``). The numbers are the publishers'; nothing here is tuned.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Citation:
    """Where a table is published: ``repository`` (GitHub owner/name), ``path`` and ``commit``."""

    repository: str
    path: str
    commit: str
    table: str

    def cite(self, row: str = "") -> str:
        where = f"{self.repository} {self.path} @{self.commit[:10]}, {self.table}"
        return f"{where}: {row}" if row else where


@dataclass(frozen=True)
class GemmRow:
    """One DeepGEMM row: ``groups`` x ``[m, k] x [k, n]`` FP8 (BF16 out) at ``tflops`` on H800."""

    layout: str  # dense | contiguous | masked
    groups: int
    m: int
    n: int
    k: int
    tflops: float

    @property
    def label(self) -> str:
        g = "" if self.layout == "dense" else f"{self.groups} groups x "
        return f"{self.layout} {g}M={self.m} N={self.n} K={self.k}: {self.tflops:g} TFLOPS"

    @property
    def flops(self) -> float:
        return 2.0 * self.groups * self.m * self.n * self.k

    @property
    def bytes(self) -> float:
        """FP8 inputs and weights, BF16 outputs: what the planner counts and DeepGEMM's GB/s column uses."""
        return float(self.groups * (self.m * self.k + self.n * self.k + 2 * self.m * self.n))

    @property
    def time_us(self) -> float:
        return self.flops / (self.tflops * 1e12) * 1e6


@dataclass(frozen=True)
class CollectiveRow:
    """One published all-to-all latency: ``tokens`` per GPU, hidden 7168, top-8, at ``ep`` GPUs."""

    source: str  # key of COLLECTIVE_CITATIONS
    link: str  # nvlink | ib (what the traffic that leaves a GPU crosses)
    direction: str  # dispatch | combine
    ep: int
    tokens: int
    time_us: float
    payload_bytes: float  # per (token, expert) copy: FP8 + scales dispatch, BF16 combine (TensorRT-LLM: BF16)
    gpus_per_node: int = 8

    @property
    def label(self) -> str:
        return f"{self.direction} EP{self.ep}, {self.tokens} tokens/GPU: {self.time_us:g} us"


HIDDEN = 7168
FP8_TOKEN = HIDDEN + HIDDEN // 128 * 4  # FP8 values + one fp32 scale per 128 (DeepEP's dispatch payload)
BF16_TOKEN = 2 * HIDDEN

DEEPGEMM = Citation("deepseek-ai/DeepGEMM", "README.md", "55ab91f72f76e8a6db0e86282c3169a88d93df1b",
                    "Performance (H800 SXM5, NVCC 12.8)")
DEEPEP_LL = Citation("deepseek-ai/DeepEP", "README.md", "d8dd185c686cddff0c13b49f640ce9cad4030d03",
                     "Low-latency kernels with pure RDMA (H800, CX7 400 Gb/s, 128 tokens, FP8 dispatch, "
                     "BF16 combine)")
DEEPEP_NORMAL = Citation("deepseek-ai/DeepEP", "README.md", "d8dd185c686cddff0c13b49f640ce9cad4030d03",
                         "Normal kernels with NVLink and RDMA forwarding (H800, ~160 GB/s NVLink)")
PPLX = Citation("perplexityai/pplx-kernels", "README.md", "2bd6e30fab358829bd01d1c0907be8088ff9e5e1",
                "Benchmark Results (Hopper: the build targets sm_90a; the README names no GPU)")
TRTLLM_A2A = Citation("NVIDIA/TensorRT-LLM",
                      "docs/source/blogs/tech_blog/"
                      "blog18_Optimizing_MoE_Communication_with_One_Sided_AlltoAll_Over_NVLink.md",
                      "22de8b34df71bb6653612c1f3de00c7288482eb4",
                      "NVLinkOneSided on GB200 NVL72, BF16 dispatch and combine")
FLASHMLA = Citation("deepseek-ai/FlashMLA", "README.md", "c2067be3eaa0f2e98e10854c30898139d5d01d36",
                    "Performance Update (2025.04.22), H800 SXM5, CUDA 12.8")
FLASHMLA_SPARSE = Citation("deepseek-ai/FlashMLA", "README.md", "fd249aacce56327affecd16f89e035b12691974f",
                           "token-level sparse MLA decoding, FP8 KV cache, BF16 matmul (H800; B200 not yet optimized)")
COLLECTIVE_CITATIONS = {"deepep_ll": DEEPEP_LL, "pplx": PPLX, "trtllm": TRTLLM_A2A}

# DeepGEMM README "Normal GEMMs for dense models" and "Grouped GEMMs for MoE models" (the tables as
# updated 2025-03-25; removed from the README in April 2025).
_DENSE = ((64, 2112, 7168, 206), (64, 24576, 1536, 289), (64, 32768, 512, 219), (64, 7168, 16384, 336),
          (64, 4096, 7168, 287), (64, 7168, 2048, 295), (128, 2112, 7168, 352), (128, 24576, 1536, 535),
          (128, 32768, 512, 358), (128, 7168, 16384, 645), (128, 4096, 7168, 533), (128, 7168, 2048, 510),
          (4096, 2112, 7168, 1009), (4096, 24576, 1536, 1125), (4096, 32768, 512, 751), (4096, 7168, 16384, 1426),
          (4096, 4096, 7168, 1265), (4096, 7168, 2048, 1168))
_CONTIGUOUS = ((4, 8192, 4096, 7168, 1346), (4, 8192, 7168, 2048, 1214), (8, 4096, 4096, 7168, 1346),
               (8, 4096, 7168, 2048, 1214))
_MASKED = ((1, 1024, 4096, 7168, 1233), (1, 1024, 7168, 2048, 925), (2, 512, 4096, 7168, 1040),
           (2, 512, 7168, 2048, 916), (4, 256, 4096, 7168, 932), (4, 256, 7168, 2048, 815))
DEEPGEMM_ROWS: tuple[GemmRow, ...] = (
    *(GemmRow("dense", 1, m, n, k, t) for m, n, k, t in _DENSE),
    *(GemmRow("contiguous", g, m, n, k, t) for g, m, n, k, t in _CONTIGUOUS),
    *(GemmRow("masked", g, m, n, k, t) for g, m, n, k, t in _MASKED),
)

# DeepEP README (2025-06-05 numbers; EP8 goes over NVLink since that version), 128 tokens per GPU.
_DEEPEP_LL = ((8, 77, 114), (16, 118, 195), (32, 155, 273), (64, 173, 314), (128, 192, 369), (256, 194, 360))
# pplx-kernels README, 1 and 128 tokens per GPU, NVLink at EP8 and IBGDA at EP16-128 (the +/- dropped).
_PPLX_1 = {"nvlink": {8: (41.6, 41.7)},
           "ib": {16: (102.7, 62.7), 32: (115.7, 55.4), 64: (121.0, 58.6), 128: (125.9, 63.2)}}
_PPLX_128 = {"nvlink": {8: (83.6, 102.3)},
             "ib": {16: (622.4, 668.1), 32: (427.6, 481.4), 64: (317.4, 529.9), 128: (307.7, 593.9)}}
# TensorRT-LLM tech blog 18: (EP, tokens per rank, dispatch us, combine us), BF16 both ways.
_TRTLLM = ((8, 1, 18.9, 31.0), (8, 128, 31.7, 38.1), (8, 256, 50.8, 53.0), (8, 512, 89.5, 91.7),
           (8, 1024, 166.3, 175.6), (8, 2048, 311.8, 322.6),
           (16, 1, 18.8, 30.8), (16, 128, 34.6, 39.9), (16, 256, 54.8, 57.0), (16, 512, 97.1, 98.2),
           (16, 1024, 181.2, 188.2), (16, 2048, 343.3, 348.4),
           (32, 1, 19.8, 31.4), (32, 128, 37.8, 41.1), (32, 256, 61.5, 59.7), (32, 512, 109.6, 102.5),
           (32, 1024, 197.5, 197.5), (32, 2048, 373.7, 369.5),
           (64, 1, 27.8, 32.6), (64, 128, 41.6, 44.5), (64, 256, 65.3, 62.9), (64, 512, 115.7, 106.7),
           (64, 1024, 209.4, 199.2), (64, 2048, 399.2, 372.1))


def _directions(source: str, link: str, ep: int, tokens: int, times: tuple[float, float], node: int = 8,
                payload: tuple[float, float] = (FP8_TOKEN, BF16_TOKEN)) -> tuple[CollectiveRow, ...]:
    return tuple(CollectiveRow(source, link, d, ep, tokens, t, p, node)
                 for d, t, p in zip(("dispatch", "combine"), times, payload))


COLLECTIVE_ROWS: tuple[CollectiveRow, ...] = (
    *(r for ep, d, c in _DEEPEP_LL
      for r in _directions("deepep_ll", "nvlink" if ep <= 8 else "ib", ep, 128, (d, c))),
    *(r for tokens, table in ((1, _PPLX_1), (128, _PPLX_128)) for link, by_ep in table.items()
      for ep, times in by_ep.items() for r in _directions("pplx", link, ep, tokens, times)),
    *(r for ep, tokens, d, c in _TRTLLM
      for r in _directions("trtllm", "nvlink", ep, tokens, (d, c), 72, (BF16_TOKEN, BF16_TOKEN))),
)

# DeepEP normal kernels, intranode EP8 on H800: bottleneck NVLink bandwidth, dispatch and combine (GB/s).
DEEPEP_NORMAL_NVLINK_GBS = (153.0, 158.0)
H800_NVLINK_GBS = 200.0  # per direction, datasheet (DeepEP measures against ~160 GB/s achievable)

# FlashMLA: dense MLA decode peaks on H800 (GB/s memory-bound, TFLOP/s compute-bound, BF16), and the
# sparse decode kernel's compute-bound TFLOP/s on H800 and on B200 (FP8 KV cache, BF16 matmul).
FLASHMLA_DENSE_GBS, FLASHMLA_DENSE_TFLOPS = 3000.0, 660.0
FLASHMLA_SPARSE_TFLOPS = {"h800": 410.0, "b200": 350.0}
