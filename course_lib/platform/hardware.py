"""GPU facts the cost model needs: memory, bandwidth, peak FLOP/s, on-chip SRAM, SM count.

Every number comes from the vendor's datasheet or architecture whitepaper named in the GPU's
``source`` field (dense figures: NVIDIA also quotes "with sparsity" numbers that are twice as
large; we never use those). Units are the datasheets' decimal ones:

* memory in GB (1 GB = 10⁹ bytes) — ``memory_bytes`` converts;
* bandwidth in GB/s (10⁹ bytes/s) — ``bandwidth_bytes_per_s`` converts;
* peak throughput in TFLOP/s (10¹² FLOP/s) — ``peak_flops(dtype)`` converts;
* on-chip SRAM in KiB per SM (the whitepapers' "KB" of SRAM are binary, 1 KB = 1024 bytes).

Names here are imported by other chapters and by the benchmark code (``GPUS``, ``get_gpu``,
``balance_point``, ``GPU`` and its fields): keep them stable.

Chapter 02 uses this table for the balance point ``peak FLOP/s ÷ bandwidth`` (FLOP per byte): an
operation with fewer FLOPs per byte of HBM traffic than that is limited by memory, not by math.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "DEFAULT_GPU", "H100_EXP_TFLOPS", "H100_FP8_TFLOPS", "GB", "KIB", "TERA", "get_gpu", "gpu_names",
           "balance_point", "normalize_dtype", "dtype_name"]

GB = 10**9  # datasheet gigabyte (memory sizes and bandwidths)
KIB = 1024  # whitepaper "KB" of on-chip SRAM
TERA = 10**12  # TFLOP/s → FLOP/s

# Precision names the table knows, with the aliases people type.
_DTYPE_ALIASES = {
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}


def dtype_name(dtype) -> str:
    """Lower-case name of a dtype given as a string, NumPy dtype/type or torch dtype."""
    if isinstance(dtype, str):
        return dtype.lower()
    if type(dtype).__module__ == "torch":
        return str(dtype).replace("torch.", "")
    import numpy as np

    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def normalize_dtype(dtype) -> str:
    """A dtype given as a string, NumPy dtype or torch dtype → ``"float16"``, ``"bfloat16"`` or
    ``"float32"``. Raises ValueError naming ``dtype`` for anything else."""
    name = dtype_name(dtype)
    if name not in _DTYPE_ALIASES:
        raise ValueError(f"dtype must be one of float16, bfloat16 or float32 (or fp16/bf16/fp32), "
                         f"got {dtype!r}")
    return _DTYPE_ALIASES[name]


@dataclass(frozen=True)
class GPU:
    """One GPU's headline figures (dense, no sparsity), with where they come from.

    Attributes:
        name: the key in :data:`GPUS`, e.g. ``"H100 SXM"``.
        memory_gb: HBM/GDDR capacity in datasheet GB (10⁹ bytes).
        bandwidth_gb_s: peak memory bandwidth in GB/s.
        fp16_tflops: peak dense FP16 tensor-core throughput (FP32 accumulate), TFLOP/s.
        bf16_tflops: peak dense BF16 tensor-core throughput (FP32 accumulate), TFLOP/s.
        fp32_tflops: peak FP32 throughput on the ordinary (non-tensor) cores, TFLOP/s.
        sram_kib_per_sm: combined L1 cache / shared memory per SM, KiB.
        max_shared_kib_per_sm: the most of that a kernel can use as shared memory, KiB.
        sm_count: streaming multiprocessors.
        memory_type: "HBM2", "HBM3", "GDDR6X", ...
        source: the documents the figures are taken from.
        notes: anything a reader comparing sources should know.
    """

    name: str
    memory_gb: float
    bandwidth_gb_s: float
    fp16_tflops: float
    bf16_tflops: float
    fp32_tflops: float
    sram_kib_per_sm: int
    max_shared_kib_per_sm: int
    sm_count: int
    memory_type: str
    source: str
    notes: str = ""

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes."""
        return self.memory_gb * GB

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """Memory bandwidth in bytes per second."""
        return self.bandwidth_gb_s * GB

    @property
    def total_sram_bytes(self) -> int:
        """L1/shared memory summed over all SMs, bytes (the "~20 MB of SRAM" of an A100)."""
        return self.sram_kib_per_sm * KIB * self.sm_count

    def peak_tflops(self, dtype="float16") -> float:
        """Peak dense TFLOP/s for ``dtype`` (float16/bfloat16 on tensor cores, float32 without)."""
        return {"float16": self.fp16_tflops, "bfloat16": self.bf16_tflops,
                "float32": self.fp32_tflops}[normalize_dtype(dtype)]

    def peak_flops(self, dtype="float16") -> float:
        """Peak dense FLOP/s for ``dtype``."""
        return self.peak_tflops(dtype) * TERA


_A100_WHITEPAPER = "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), Table 1 and §'A100 SM'"
_HOPPER_WHITEPAPER = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), Table 3"

# Hopper figures that are not in the GPU table (chapter 09). The FlashAttention-3 paper (Shah et
# al., 2024, section 3.1) gives the H100 SXM5's special-function (exp) throughput as 3.9 TFLOP/s
# against 989 TFLOP/s of FP16 matmul; the reading rounds it to "~4 TFLOPs". FP8 (e4m3/e5m2) dense
# tensor-core peak: twice FP16, 1,979 TFLOP/s (the datasheet's 3,958 is "with sparsity").
H100_EXP_TFLOPS = 3.9
H100_FP8_TFLOPS = 1978.9

GPUS: dict[str, GPU] = {
    gpu.name: gpu
    for gpu in [
        GPU(
            name="A100 40GB",
            memory_gb=40, bandwidth_gb_s=1555,
            fp16_tflops=312, bf16_tflops=312, fp32_tflops=19.5,
            sram_kib_per_sm=192, max_shared_kib_per_sm=164, sm_count=108,
            memory_type="HBM2",
            source=f"NVIDIA A100 Tensor Core GPU datasheet (SXM4 40GB column); {_A100_WHITEPAPER}",
        ),
        GPU(
            name="A100 80GB PCIe",
            memory_gb=80, bandwidth_gb_s=1935,
            fp16_tflops=312, bf16_tflops=312, fp32_tflops=19.5,
            sram_kib_per_sm=192, max_shared_kib_per_sm=164, sm_count=108,
            memory_type="HBM2e",
            source=f"NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe column); {_A100_WHITEPAPER}",
            notes="1,935 GB/s is the bandwidth behind the reading's 161 FLOP/byte balance point.",
        ),
        GPU(
            name="A100 80GB",
            memory_gb=80, bandwidth_gb_s=2039,
            fp16_tflops=312, bf16_tflops=312, fp32_tflops=19.5,
            sram_kib_per_sm=192, max_shared_kib_per_sm=164, sm_count=108,
            memory_type="HBM2e",
            source=f"NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column); {_A100_WHITEPAPER}",
            notes="SXM module; often rounded to '2 TB/s' (the reading's 156 FLOP/byte).",
        ),
        GPU(
            name="H100 SXM",
            memory_gb=80, bandwidth_gb_s=3350,
            fp16_tflops=989.4, bf16_tflops=989.4, fp32_tflops=66.9,
            sram_kib_per_sm=256, max_shared_kib_per_sm=228, sm_count=132,
            memory_type="HBM3",
            source=f"NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column); {_HOPPER_WHITEPAPER}",
            notes="Datasheet prints 1,979 TFLOP/s FP16 'with sparsity'; dense is half. "
                  "Measured on our H100: ~3.0 TB/s device copy, ~740 TFLOP/s bf16 matmul (FACTS.md).",
        ),
        GPU(
            name="H200",
            memory_gb=141, bandwidth_gb_s=4800,
            fp16_tflops=989.4, bf16_tflops=989.4, fp32_tflops=66.9,
            sram_kib_per_sm=256, max_shared_kib_per_sm=228, sm_count=132,
            memory_type="HBM3e",
            source=f"NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column); {_HOPPER_WHITEPAPER} "
                   f"(same Hopper GH100 SMs as H100 SXM)",
            notes="Same compute as H100 SXM, more and faster memory.",
        ),
        GPU(
            name="RTX 4090",
            memory_gb=24, bandwidth_gb_s=1008,
            fp16_tflops=165.2, bf16_tflops=165.2, fp32_tflops=82.6,
            sram_kib_per_sm=128, max_shared_kib_per_sm=100, sm_count=128,
            memory_type="GDDR6X",
            source="NVIDIA Ada GPU Architecture whitepaper (v2.1), Appendix A, Table 2 (GeForce RTX 4090)",
            notes="Tensor figures are with FP32 accumulate (what attention uses); with FP16 "
                  "accumulate GeForce cards run FP16 at twice that (330.3 TFLOP/s).",
        ),
    ]
}

DEFAULT_GPU = "A100 80GB"


def gpu_names() -> list[str]:
    """Names accepted by :func:`get_gpu`, in table order."""
    return list(GPUS)


def get_gpu(gpu) -> GPU:
    """Look up a GPU by name (case and spaces ignored: ``"h100 sxm"``, ``"H100SXM"``), or pass a
    :class:`GPU` through. Raises ValueError naming ``gpu`` and listing the known names."""
    if isinstance(gpu, GPU):
        return gpu
    if not isinstance(gpu, str):
        raise TypeError(f"gpu must be a GPU name (str) or a GPU, got {type(gpu).__name__}")
    wanted = gpu.replace(" ", "").lower()
    for name, spec in GPUS.items():
        if name.replace(" ", "").lower() == wanted:
            return spec
    raise ValueError(f"gpu must be one of {', '.join(GPUS)}; got {gpu!r}")


def balance_point(gpu, dtype="float16") -> float:
    """FLOP per byte of HBM traffic at which ``gpu`` is equally limited by math and by memory:
    peak FLOP/s ÷ bandwidth (bytes/s). Below it a kernel is memory-bound, above it compute-bound.

    >>> round(balance_point("A100 80GB PCIe"), 1)
    161.2
    """
    spec = get_gpu(gpu)
    return spec.peak_flops(dtype) / spec.bandwidth_bytes_per_s


# ----------------------------------------------------------------------------------------------
# Compute capabilities the Triton kernels are compiled for (course_lib.measure.reach, kernels/fit.py)


@dataclass(frozen=True)
class ComputeTarget:
    """What a compiled kernel may use on GPUs of one compute capability.

    Fields:
        capability: (major, minor), e.g. (8, 6); arch: Triton's target number (86).
        examples: GPUs of that capability.
        max_shared_kib_per_block: the most shared memory one block may ask for (opt-in), KiB:
            what Triton checks at the first launch ("out of resource: shared memory").
        fp8_dots: the tensor cores multiply fp8 (e4m3/e5m2) operands (Ada, Hopper, Blackwell).
        tma: the Tensor Memory Accelerator behind Triton's tensor descriptors (Hopper, Blackwell).
        wgmma: Hopper's warpgroup matrix multiply (``wgmma``), which the Gluon kernels and the
            library's descriptor forward are written for: they run on 9.x only. Blackwell has
            ``tcgen05`` with tensor memory instead (10.0) or neither (12.0: ``mma.sync``, as Ampere).
    """

    capability: tuple[int, int]
    examples: str
    max_shared_kib_per_block: int
    fp8_dots: bool
    tma: bool
    wgmma: bool

    @property
    def arch(self) -> int:
        return 10 * self.capability[0] + self.capability[1]

    @property
    def max_shared_bytes_per_block(self) -> int:
        return self.max_shared_kib_per_block * KIB


# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability": maximum shared
# memory per thread block 163 KB (8.0), 99 KB (8.6, 8.9, 12.0), 227 KB (9.0, 10.0); each is its SM's
# shared memory (max_shared_kib_per_sm above) less the 1 KiB the system keeps per block. 12.0 is
# Blackwell's workstation and consumer chip (GB202/GB203...): TMA, fp8, no wgmma and no tcgen05.
COMPUTE_TARGETS = {
    t.arch: t for t in [
        ComputeTarget((8, 0), "A100", 163, fp8_dots=False, tma=False, wgmma=False),
        ComputeTarget((8, 6), "A10, A40, RTX 3090, RTX A6000", 99, fp8_dots=False, tma=False, wgmma=False),
        ComputeTarget((8, 9), "L4, L40S, RTX 4090", 99, fp8_dots=True, tma=False, wgmma=False),
        ComputeTarget((9, 0), "H100, H200", 227, fp8_dots=True, tma=True, wgmma=True),
        ComputeTarget((10, 0), "B200, GB200", 227, fp8_dots=True, tma=True, wgmma=False),
        ComputeTarget((12, 0), "RTX 50xx, RTX PRO 6000 (Colab's G4)", 99, fp8_dots=True, tma=True, wgmma=False),
    ]
}


def compute_target(capability) -> ComputeTarget | None:
    """The :data:`COMPUTE_TARGETS` entry of a ``(major, minor)`` compute capability, None if unknown."""
    return COMPUTE_TARGETS.get(10 * capability[0] + capability[1])
