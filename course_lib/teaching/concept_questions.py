"""The concept checks that end each chapter: 3–6 short questions, every answer explained.

In the spirit of the CS 229s notes' "Check:" questions (why doubling N quadruples the cost, why
softmax is memory-bound on an A100, what the correction factor does when a tile's max is
smaller, why recomputation beats reading P, what FA2 changed). A chapter shows its questions
with :func:`course_lib.teaching.widgets.quiz.concept_check`; :func:`questions` returns them.

Numeric answers are computed from the library (:mod:`course_lib.attention.costmodel`,
:mod:`course_lib.platform.hardware`, :mod:`course_lib.attention.iomodel`,
:mod:`course_lib.attention.kvcache`, ...) when the questions are built, so a question stays right if
the library's figures change. The questions are built on each call, not at import: importing this
module computes nothing.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from course_lib import constants
from course_lib.attention import costmodel, iomodel, kvcache, softmax
from course_lib.platform import hardware
from course_lib.teaching.quiz_types import DEFAULT_REL_TOL, MultipleChoice, Numeric, WrongAnswer

__all__ = ["CHAPTERS", "questions", "all_questions"]

MIB = 2**20
KIB = 2**10
GIB = 2**30


def _move_answer(position: int, question: MultipleChoice) -> MultipleChoice:
    """``question`` (written with its right choice first, easy to review) with the right choice
    moved to index ``position``, so that the right answer is not always the first one shown."""
    order = [i for i in range(len(question.choices)) if i != question.answer]
    order.insert(position, question.answer)
    return MultipleChoice(question.prompt, tuple(question.choices[i] for i in order), position,
                          tuple(question.explanations[i] for i in order))


# ---------------------------------------------------------------- 01: naive attention

def _chapter_01() -> list:
    n_big, d = 16_384, 64
    s_mib = costmodel.attention_memory(n_big, d, "float16").score_bytes / MIB
    n, d_small = 1024, 64
    mem = costmodel.attention_memory(n, d_small, "float16")
    ratio = mem.score_bytes / mem.qkv_bytes  # N² / 3Nd = N / 3d
    gpu = hardware.get_gpu("A100 80GB")
    n_max = costmodel.max_seq_len(gpu.memory_bytes, d, "float16")
    fp16 = costmodel.bytes_per_element("float16")
    return [
        _move_answer(2, MultipleChoice(
            "Why does doubling the sequence length N quadruple the cost of attention?",
            choices=(
                "Every query is scored against every key: N × N scores, so 2N gives 4N²",
                "Q, K and V each double, and three doublings multiply together",
                "The head dim d grows with N, so each score costs more",
                "exp grows fast, so longer rows make softmax more expensive per element",
            ),
            answer=0,
            explanations=(
                "S = QKᵀ has one entry per (query, key) pair. With 2N tokens there are 2N queries "
                "and 2N keys, so (2N)² = 4N² scores to compute, store and read back.",
                "Q, K and V are N × d each: doubling N doubles them, which is linear growth. "
                "They are not multiplied into one another's size; the N × N matrix S is what "
                "grows as N².",
                "d is fixed by the model (64 or 128 per head) and does not depend on the "
                "sequence length. The quadratic term comes from the number of (query, key) pairs.",
                "Softmax costs the same handful of FLOPs per score whatever the values are. What "
                "grows is the number of scores, N², not the cost of each.",
            ),
        )),
        Numeric(
            f"One head's score matrix S at N = {n_big:,} in float16 ({fp16} bytes per element): "
            f"how many MiB is it?",
            answer=s_mib, unit="MiB",
            explanation=f"N² = {n_big:,}² = {n_big * n_big:,} scores × {fp16} bytes = "
                        f"{s_mib:,.0f} MiB, for one head of one sequence in one layer. A model "
                        f"with many heads and layers multiplies that again.",
            hint="Count the entries of an N × N matrix, multiply by the bytes per element, then "
                 "divide by 2²⁰ bytes per MiB.",
            wrong_answers=(
                WrongAnswer(s_mib / fp16, "That is the number of entries in Mi (2²⁰) units; each "
                                          f"float16 entry takes {fp16} bytes."),
                WrongAnswer(s_mib * 2, "That would be float32 (4 bytes per element); the question "
                                       "asks for float16, 2 bytes."),
                WrongAnswer(s_mib / KIB, "That is the size in GiB; the question asks for MiB "
                                         "(1 GiB = 1024 MiB)."),
            ),
        ),
        Numeric(
            f"At N = {n:,} and d = {d_small}, how many times larger is the score matrix S than "
            f"Q, K and V together?",
            answer=ratio, unit="×",
            explanation=f"S has N² entries; Q, K and V have 3·N·d together. The ratio is "
                        f"N / 3d = {n:,} / {3 * d_small} ≈ {ratio:.2f}. It grows with N: the "
                        f"longer the sequence, the more S dominates the memory.",
            hint="Write both sizes in elements (N², and three N × d matrices) and divide; the "
                 "bytes per element cancel.",
            wrong_answers=(
                WrongAnswer(n / d_small, "N / d compares S with one of Q, K, V; the question "
                                         "asks for all three together (3·N·d)."),
                WrongAnswer(n / d_small / 4, "That compares S with Q, K, V and O together. "
                                             "The question leaves out the output O."),
            ),
        ),
        Numeric(
            f"On an {gpu.name} ({gpu.memory_gb:g} GB = {gpu.memory_gb:g}·10⁹ bytes), one head, "
            f"float16, d = {d}: roughly the largest N whose naive attention (S plus Q, K, V, O) "
            f"still fits in memory? Round to thousands of tokens.",
            answer=n_max, unit="tokens", rel_tol=0.05,
            explanation=f"S dominates: {fp16}·N² ≈ {gpu.memory_gb:g}·10⁹ bytes gives "
                        f"N ≈ √({gpu.memory_gb:g}·10⁹ / {fp16}) ≈ {n_max:,} (the linear Q, K, "
                        f"V, O terms barely move it). Fewer than a quarter of a million tokens "
                        f"for a single head: real models run out of memory far sooner.",
            hint="Set the bytes of the N × N matrix equal to the GPU's memory and solve for N; "
                 "the linear terms are small.",
            wrong_answers=(
                WrongAnswer(math.sqrt(gpu.memory_bytes),
                            "That counts one byte per score; float16 takes two, which divides "
                            "the answer by √2."),
                WrongAnswer(math.sqrt(gpu.memory_bytes / 4),
                            "That is float32 (4 bytes per score); the question asks for float16."),
                WrongAnswer(gpu.memory_bytes / fp16,
                            "Memory grows as N², not N: take the square root."),
            ),
        ),
    ]


# ---------------------------------------------------------------- 02: the memory wall

def _chapter_02() -> list:
    gpu = hardware.get_gpu("A100 80GB PCIe")
    balance = hardware.balance_point(gpu, "bfloat16")
    bf16 = costmodel.bytes_per_element("bfloat16")
    n, d = 1024, 64
    softmax_ai = costmodel.softmax_intensity(n, d, bf16)
    qk_ai = costmodel.qk_intensity(n, d, bf16)
    flops_per_score = costmodel.SOFTMAX_FLOPS_PER_ELEMENT
    return [
        Numeric(
            f"An {gpu.name} does {gpu.bf16_tflops:g} TFLOP/s in bfloat16 and moves "
            f"{gpu.bandwidth_gb_s:,.0f} GB/s from HBM. What is its balance point, in FLOP per "
            f"byte?",
            answer=balance, unit="FLOP/byte",
            explanation=f"{gpu.bf16_tflops:g}·10¹² FLOP/s ÷ {gpu.bandwidth_gb_s:,.0f}·10⁹ B/s ≈ "
                        f"{balance:.0f} FLOP/byte: a kernel must do that many FLOPs for every "
                        f"byte it moves to keep the math units busy. Below it, memory sets the "
                        f"speed.",
            hint="Divide the peak FLOP/s by the bandwidth in bytes per second, with both in the "
                 "same power of ten.",
            wrong_answers=(
                WrongAnswer(1 / balance, "That is bytes per FLOP: the division is the other way "
                                         "round (FLOP/s ÷ bytes/s)."),
                WrongAnswer(balance / 1000, "TFLOP/s are 10¹² and GB/s 10⁹: convert both before "
                                            "dividing (you are off by 1000)."),
            ),
        ),
        Numeric(
            f"The softmax kernel reads the N × N scores and writes the N × N probabilities, in "
            f"bfloat16, doing {flops_per_score} FLOPs per score. What is its arithmetic "
            f"intensity?",
            answer=softmax_ai, unit="FLOP/byte",
            explanation=f"{flops_per_score}·N² FLOPs over (N² read + N² written) × {bf16} bytes "
                        f"= {flops_per_score}/{2 * bf16} = {softmax_ai:g} FLOP/byte, whatever N "
                        f"and d are: element-wise work never gets more FLOPs per byte.",
            hint="FLOPs are per score; bytes are one read and one write per score, at 2 bytes "
                 "each. N² cancels.",
            wrong_answers=(
                WrongAnswer(softmax_ai * 2, "Count the write of P as well as the read of S: the "
                                            "bytes are doubled, so the intensity halves."),
                WrongAnswer(softmax_ai * (flops_per_score - 1) / flops_per_score,
                            f"That counts {flops_per_score - 1} FLOPs per score (one reading "
                            f"leaves out the sum); the course counts {flops_per_score}: max, "
                            f"subtract, exp, sum, divide."),
                WrongAnswer(softmax_ai / 2, "That is float32 (4 bytes); the question asks for "
                                            "bfloat16, 2 bytes per element."),
            ),
        ),
        _move_answer(1, MultipleChoice(
            f"Why is the softmax step of attention memory-bound on an {gpu.name}?",
            choices=(
                f"Its ~{softmax_ai:g} FLOP/byte is far below the GPU's ~{balance:.0f} FLOP/byte",
                "exp is an expensive instruction, so the math units are the bottleneck",
                "Its FLOPs grow as N² while its bytes grow as N",
                "It is memory-bound only for short sequences; long rows make it compute-bound",
            ),
            answer=0,
            explanations=(
                f"It moves about a byte for every FLOP, about {balance / softmax_ai:.0f}× fewer "
                f"FLOPs per byte than the GPU needs to keep its math units busy, so it runs at "
                f"the speed of HBM while the cores mostly wait.",
                f"A few FLOPs per score are nothing at {gpu.bf16_tflops:g} TFLOP/s; the time "
                f"goes into reading and writing the N² scores from and to HBM.",
                "Both grow as N²: one read and one write per score, a fixed few FLOPs per score. "
                "That is why its intensity is a constant.",
                "N cancels out of the intensity, so no length makes softmax compute-bound; only "
                "fusing it with the matmuls (never writing S to HBM) does.",
            ),
        )),
        _move_answer(3, MultipleChoice(
            f"S = QKᵀ is a matmul. At N = {n:,}, d = {d}, bfloat16, is it compute-bound on the "
            f"{gpu.name}?",
            choices=(
                f"No: about {qk_ai:.0f} FLOP/byte, below {balance:.0f}; writing S dominates",
                "Yes: matmuls are always compute-bound",
                "Yes, once N is large enough its intensity passes the balance point",
                "No, because matmuls cannot use the tensor cores in bfloat16",
            ),
            answer=0,
            explanations=(
                f"2N²d FLOPs over (2Nd read + N² written) × 2 bytes ≈ {qk_ai:.0f} FLOP/byte. "
                f"The N × N output is large next to the thin N × d inputs, so bytes are many.",
                "Only matmuls with a large inner dimension are. Here the inner dimension is d, "
                "small, while the output S has N² entries to write.",
                f"As N grows the intensity approaches 2N²d / (2·N²) = d = {d} FLOP/byte, which "
                f"is still below {balance:.0f}: this matmul never becomes compute-bound.",
                f"bfloat16 runs on the tensor cores ({gpu.bf16_tflops:g} TFLOP/s); the limit "
                f"here is the bytes moved, not the math units.",
            ),
        )),
    ]


# ---------------------------------------------------------------- 03: online softmax

def _chapter_03() -> list:
    row = np.array([1.0, 2.0, 0.5, 0.1])  # the CS 229s notes' worked example
    block = 2
    m, l = softmax.online_softmax_stats(row, block)
    m1, l1 = softmax.online_softmax_stats(row[:block], block)
    overflow = softmax.overflow_threshold(np.float32)
    return [
        _move_answer(1, MultipleChoice(
            "A new tile's max is smaller than the running max m. What is the correction factor "
            "exp(m_old − m_new) applied to the old sum and output?",
            choices=(
                "Exactly 1: the max does not change, so the old state is kept as it is",
                "Less than 1: the old sum shrinks to make room for the new tile",
                "Greater than 1: the old terms grow because the new tile's max is smaller",
                "0: the old state is thrown away and recomputed",
            ),
            answer=0,
            explanations=(
                "m_new = max(m_old, tile max) = m_old, so exp(m_old − m_new) = exp(0) = 1. Only "
                "the new tile's terms are scaled, by exp(x − m_old).",
                "That happens when the new tile's max is larger: then m_new > m_old and "
                "exp(m_old − m_new) < 1 rescales the old terms to the new max.",
                "m_new ≥ m_old always, so the factor is never above 1; the old terms never grow.",
                "Nothing is recomputed: online softmax only ever rescales the state it carries, "
                "which is what lets it see each score once.",
            ),
        )),
        Numeric(
            f"The CS 229s notes' row {row.tolist()} in tiles of {block}: what is the running sum l "
            f"after both tiles (relative to the final max {m:g})?",
            answer=float(l), rel_tol=0.01,
            explanation=f"Tile 1: m = {m1:g}, l = e⁻¹ + e⁰ ≈ {l1:.3f}. Tile 2's max "
                        f"{row[block:].max():g} is "
                        f"smaller, so the correction is 1 and l grows by e^(0.5−2) + e^(0.1−2): "
                        f"l ≈ {l:.3f}, the same as a two-pass softmax over the whole row.",
            hint="Keep m = 2 from the first tile; add exp(x − 2) for every score of both tiles.",
            wrong_answers=(
                WrongAnswer(float(l1), "That is l after the first tile only; the second tile "
                                       "still adds its terms, scaled to the running max."),
                WrongAnswer(float(np.exp(row).sum()),
                            "That is Σ exp(x) without subtracting the max: l is taken relative "
                            "to m, Σ exp(x − m)."),
            ),
        ),
        _move_answer(0, MultipleChoice(
            "Why does safe softmax subtract the row's max before taking exp?",
            choices=(
                f"exp overflows float32 above ~{overflow:.0f}; after the shift the largest "
                f"exponent is 0",
                "It makes the probabilities sum to 1",
                "It makes the result slightly different but more accurate",
                "It stops small scores from underflowing to 0",
            ),
            answer=0,
            explanations=(
                f"exp(x) is infinite in float32 for x above {overflow:.2f}. exp(x − m) / "
                f"Σ exp(x − m) equals the textbook formula (exp(m) cancels), and every exponent "
                f"is ≤ 0, so nothing overflows.",
                "Dividing by the sum does that, with or without the shift.",
                "The result is mathematically the same: exp(−m) cancels between numerator and "
                "denominator. The shift changes only whether it can be computed.",
                "Small scores can still underflow after the shift, and that is harmless: their "
                "weights really are negligible. The shift is there for the large ones.",
            ),
        )),
        _move_answer(2, MultipleChoice(
            "Two partial states (m_a, l_a) and (m_b, l_b) over different keys are merged. With "
            "m = max(m_a, m_b), what is the merged l?",
            choices=(
                "l_a·exp(m_a − m) + l_b·exp(m_b − m)",
                "l_a + l_b",
                "max(l_a, l_b)",
                "(l_a + l_b)·exp(m_a − m_b)",
            ),
            answer=0,
            explanations=(
                "Each sum was taken relative to its own max; rescaling both to the common max m "
                "makes them comparable, and then they add. That is why merges can happen in any "
                "order.",
                "l_a and l_b are relative to different maxes, so adding them directly mixes "
                "units; it is right only when m_a = m_b.",
                "A sum over more keys is the sum of both parts, not the larger part.",
                "That rescales both sums by the same factor; each needs its own, exp(m_a − m) "
                "and exp(m_b − m).",
            ),
        )),
    ]


# ---------------------------------------------------------------- 04: tiled attention

def _chapter_04() -> list:
    n, block_m = 4096, 128
    t_r = iomodel.num_blocks(n, block_m)
    sram, d = 100_000, 64
    sram_ratio = iomodel.flash_asymptotic(n, d, 2 * sram) / iomodel.flash_asymptotic(n, d, sram)
    return [
        _move_answer(3, MultipleChoice(
            "What is the key obstacle to computing attention tile by tile?",
            choices=(
                "Softmax needs each row's max and sum over all N keys; a tile sees only B_c",
                "QKᵀ cannot be split into blocks",
                "No tile is small enough to fit in SRAM",
                "Tiling changes the result, so the output is only approximate",
            ),
            answer=0,
            explanations=(
                "The normaliser of a row depends on every score in it, but a tile holds only "
                "some of them. Online softmax carries a running max and sum per row and rescales, "
                "so the tiles still give the exact answer.",
                "Matmuls split into blocks easily: each tile of S is Q_i K_jᵀ. The matmuls are "
                "not the problem.",
                "Block sizes are chosen so that the Q, K, V and O tiles fit in SRAM (B_c ≈ M/4d); "
                "a few tens of KB is enough.",
                "With online softmax the tiled computation is exact: the same output as standard "
                "attention up to floating-point rounding.",
            ),
        )),
        Numeric(
            f"In the FA2 order (outer loop over Q tiles), N = {n:,} and BLOCK_M = {block_m}: how "
            f"many times is each element of K and V read from HBM?",
            answer=t_r, unit="times", rel_tol=0,
            explanation=f"Each of the T_r = ⌈N / BLOCK_M⌉ = {t_r} Q tiles loops over all of K "
                        f"and V, so they are read {t_r} times; Q is read once and O written once. "
                        f"Bigger Q tiles mean fewer passes over K and V.",
            hint="Count the Q tiles: each one runs the inner loop over every K/V tile.",
            wrong_answers=(
                WrongAnswer(1, "That is the FA1 order (outer loop over K/V tiles): K and V are "
                               "read once there, but Q, O, m and l go back and forth T_c times."),
                WrongAnswer(n, "That would be one query row at a time; a tile of BLOCK_M rows "
                               "shares each K/V load among its rows."),
            ),
        ),
        _move_answer(1, MultipleChoice(
            "Why does the FA2 loop order move less data through HBM than the FA1 order?",
            choices=(
                "A Q tile's o, m and l stay on chip for all K/V tiles and are written once",
                "FA2 reads K and V fewer times than FA1",
                "FA2 does fewer FLOPs in its two matmuls",
                "FA2 skips the tiles whose scores are small",
            ),
            answer=0,
            explanations=(
                "In FA1 every K/V tile of the outer loop reads each Q tile's o, m and l back from "
                "HBM and writes them again, T_c times; in FA2 they live in SRAM until the row is "
                "done, then o and lse are written once.",
                "The opposite: FA2 reads K and V once per Q tile (T_r times), FA1 once. FA2 wins "
                "because it stops moving o, m and l.",
                "Both orders compute the same tiles with the same matmuls; only the bookkeeping "
                "FLOPs and the traffic differ.",
                "Neither skips tiles by value; that would change the result. Only a mask (causal, "
                "sliding window) lets a tile be skipped exactly.",
            ),
        )),
        Numeric(
            "FlashAttention's HBM accesses grow as Θ(N²d²/M). If the on-chip memory M doubles "
            "(same N and d), by what factor does its HBM traffic change?",
            answer=sram_ratio, unit="×",
            explanation="M is in the denominator: twice the SRAM allows tiles twice as large, so "
                        "K and V are streamed half as many times: the traffic halves (× 0.5).",
            hint="Look at where M sits in N²d²/M.",
            wrong_answers=(
                WrongAnswer(1 / sram_ratio, "Traffic goes down, not up: M is in the "
                                            "denominator. More SRAM means bigger tiles and fewer "
                                            "passes."),
                WrongAnswer(1, "M does matter: it sets the tile size, and with it how many times "
                               "K and V are read."),
                WrongAnswer(sram_ratio ** 2, "M appears to the first power, not squared (it is "
                                             "d that is squared)."),
            ),
        ),
    ]


# ---------------------------------------------------------------- 05: Triton primer

def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _chapter_05() -> list:
    n_elements, block = 10_000, 1024
    programs = iomodel.num_blocks(n_elements, block)
    n_cols = 781  # the notebook's row width
    row_block = _next_power_of_two(n_cols)
    return [
        Numeric(
            f"A vector add over {n_elements:,} elements with BLOCK_SIZE = {block}: how many "
            f"programs must the grid launch?",
            answer=programs, unit="programs", rel_tol=0,
            explanation=f"⌈{n_elements:,} / {block}⌉ = {programs}: the last program covers "
                        f"elements {(programs - 1) * block:,} to {n_elements - 1:,} and masks "
                        f"the rest of its block.",
            hint="Round the division up: a partly filled last block still needs a program.",
            wrong_answers=(
                WrongAnswer(n_elements // block, "Rounding down leaves the last "
                                                 f"{n_elements % block} elements unadded; the "
                                                 f"grid is ⌈n / BLOCK_SIZE⌉ (triton.cdiv)."),
            ),
        ),
        _move_answer(0, MultipleChoice(
            "Why does that last program load and store with a mask?",
            choices=(
                "Its block runs past the end of the tensor; unmasked it would touch other memory",
                "The mask skips elements that are zero, to save work",
                "Only the interpreter needs it; on a GPU out-of-bounds accesses are caught",
                "Masks make loads faster by telling the GPU which elements are cached",
            ),
            answer=0,
            explanations=(
                "offsets = pid·BLOCK_SIZE + arange(BLOCK_SIZE) goes past n for the last block; "
                "mask = offsets < n keeps those lanes from reading or writing memory that is not "
                "the tensor's.",
                "The mask depends only on the index, not on the values: zeros are added like any "
                "other number.",
                "Neither catches it reliably: the interpreter reads whatever lies there, and a GPU "
                "may crash or silently corrupt memory. The mask is needed in both.",
                "A mask says which lanes exist, not what is cached; masked lanes are skipped, not "
                "sped up.",
            ),
        )),
        _move_answer(2, MultipleChoice(
            f"The fused row softmax keeps one row in one block. For rows of {n_cols} columns, "
            f"which BLOCK_SIZE, and what fills the unused lanes?",
            choices=(
                f"{row_block}, with the extra lanes loaded as −inf",
                f"{n_cols}, exactly the row width, so no lane is wasted",
                f"{row_block}, with the extra lanes loaded as 0",
                f"{row_block // 2}, and the row is processed in two blocks",
            ),
            answer=0,
            explanations=(
                f"tl.arange needs a power of two, so the block is the next one, {row_block}. "
                f"Loading missing columns as −inf gives them exp(−inf) = 0 weight and leaves the "
                f"row's max alone.",
                f"tl.arange only takes powers of two: {n_cols} fails to compile (the notebook's "
                f"error example).",
                "A 0 is a real score: exp(0 − m) > 0 would add weight to columns that do not "
                "exist, and the row would no longer sum to 1 over its real columns.",
                "This kernel finds the max and the sum in one block, so the whole row must fit in "
                "it; splitting a row needs online softmax (chapter 03).",
            ),
        )),
        _move_answer(3, MultipleChoice(
            "What does fusing the row softmax into one kernel save, compared with separate "
            "max, exp, sum and divide kernels?",
            choices=(
                "HBM traffic: the row is read once and written once, the steps between stay on chip",
                "FLOPs: the fused kernel does fewer operations per element",
                "Precision: fused kernels round less",
                "Nothing on a GPU; fusion only helps the interpreter",
            ),
            answer=0,
            explanations=(
                "Separate kernels write each intermediate to HBM and read it back. Softmax is "
                "memory-bound, so cutting the bytes is what makes it faster.",
                "The same max, subtract, exp, sum and divide happen either way; what changes is "
                "where the intermediates live.",
                "Rounding is the same per operation; the gain is in memory traffic, not accuracy.",
                "It is the other way round: the interpreter gains nothing, and on a GPU the saved "
                "HBM round trips are the whole speed-up.",
            ),
        )),
    ]


# ---------------------------------------------------------------- 06: forward kernel in Triton

def _chapter_06() -> list:
    n, block = 1024, 128
    t = iomodel.num_blocks(n, block)
    n_ragged, block_n = 1000, 64
    last_rows = iomodel.block_rows(iomodel.num_blocks(n_ragged, block_n) - 1, n_ragged, block_n)
    computed = int((~iomodel.causal_skip_grid(n, n, block, block)).sum())
    diagonal = t
    return [
        Numeric(
            "The kernels compute exp(x) as exp2(x · c), because GPUs have a fast exp2 "
            "instruction. What is c (to 4 decimals)?",
            answer=constants.LOG2_E, rel_tol=1e-3,
            explanation=f"exp(x) = 2^(x·log₂e), so c = log₂e ≈ {constants.LOG2_E:.4f} "
                        f"(LOG2_E). The kernel folds it into the softmax scale, so the change "
                        f"costs no extra multiply.",
            hint="Write e^x as a power of 2: e = 2^(something).",
            wrong_answers=(
                WrongAnswer(constants.LN_2, "That is ln 2 = 1 / log₂e: it converts the other way "
                                            "(log₂ back to ln, as for the lse)."),
                WrongAnswer(math.e, "That is e itself; exp2 needs the exponent rescaled by "
                                    "log₂e."),
            ),
        ),
        Numeric(
            f"Causal attention, N = {n:,}, BLOCK_M = BLOCK_N = {block}: of the {t * t} tiles, "
            f"how many does the kernel compute (the rest are skipped)?",
            answer=computed, unit="tiles", rel_tol=0,
            explanation=f"Q tile i needs K/V tiles 0 to i: 1 + 2 + … + {t} = {computed}. The "
                        f"{diagonal} diagonal tiles are computed with the mask applied; the "
                        f"{t * t - computed} tiles above the diagonal are skipped without loading.",
            hint="Count, for each Q tile, the K/V tiles whose first key is not after the tile's "
                 "last query.",
            wrong_answers=(
                WrongAnswer(t * t // 2, "Exactly half misses the diagonal tiles: they are partly "
                                        "visible and must be computed, with the mask."),
                WrongAnswer(computed - diagonal, "That counts only the fully visible tiles; the "
                                                 "diagonal ones are computed too, masked."),
                WrongAnswer(t * t, "That is every tile: tiles entirely above the diagonal hold "
                                   "only masked scores and are skipped."),
            ),
        ),
        _move_answer(1, MultipleChoice(
            f"N = {n_ragged} is not a multiple of BLOCK_N = {block_n}. How does the kernel treat "
            f"the last K/V tile's missing rows?",
            choices=(
                "Loads them masked and sets their scores to −inf, so they get weight 0",
                "Loads them as zeros, which adds nothing to the output",
                "Requires N to be padded to a multiple of BLOCK_N before the call",
                "Skips the last tile entirely",
            ),
            answer=0,
            explanations=(
                "Keys past N do not exist: a score of −inf makes exp give exactly 0, so they "
                "change neither the max nor the sum nor the output.",
                "A zero key gives a score of 0, and exp(0 − m) > 0: the padded rows would steal "
                "weight from the real keys. Zero is a value, −inf is 'absent'.",
                "The kernel handles ragged N itself with masks; padding would cost memory and a "
                "copy.",
                f"Its first {last_rows} rows are real keys; skipping it would leave them out.",
            ),
        )),
        _move_answer(2, MultipleChoice(
            "Besides o, what does the forward kernel save for the backward pass?",
            choices=(
                "lse = m + log l, one number per query row",
                "P, the N × N attention probabilities",
                "S, the N × N scores before softmax",
                "Nothing: the backward recomputes the forward from scratch",
            ),
            answer=0,
            explanations=(
                "With lse, the backward rebuilds any tile of P as exp(S − lse) from Q and K "
                "tiles: N numbers instead of N².",
                "Storing P is what FlashAttention avoids: O(N²) memory and traffic.",
                "S is N × N too; and without the row statistics it could not be turned into P "
                "tile by tile.",
                "Recomputing from scratch would need a second full pass to find each row's max "
                "and sum; saving lse makes one pass enough.",
            ),
        )),
    ]


# ---------------------------------------------------------------- 07: the backward pass

def _chapter_07() -> list:
    n = 16_384
    lse_bytes = costmodel.bytes_per_element("float32")
    lse_kib = n * lse_bytes / KIB
    p_mib = costmodel.attention_memory(n, 64, "float16").score_bytes / MIB
    fwd_bwd = 1 + costmodel.FA_BACKWARD_FLOP_RATIO
    balance = hardware.balance_point(hardware.DEFAULT_GPU)
    return [
        _move_answer(0, MultipleChoice(
            "Why is recomputing the attention tiles in the backward pass faster than reading a "
            "stored N × N matrix P from HBM?",
            choices=(
                "Attention is memory-bound: FLOPs on chip are cheap, bytes from HBM are not",
                "Recomputing does fewer FLOPs than reading",
                "A stored P would be less accurate than a recomputed one",
                "P cannot be stored at all, whatever N is",
            ),
            answer=0,
            explanations=(
                f"The GPU can do ~{balance:.0f} FLOPs in the time it moves one byte. Recomputing "
                f"a tile from Q and K tiles already in SRAM costs extra FLOPs, but it replaces "
                f"reading N² elements, which costs bandwidth.",
                "It does more: the S = QKᵀ matmul is done again. It is faster because it trades "
                "those FLOPs for far fewer bytes.",
                "Both give the same values up to rounding; the reason is speed and memory, not "
                "accuracy.",
                "It can be stored for short sequences (standard attention does); it is just "
                "O(N²) memory and slow to read.",
            ),
        )),
        Numeric(
            f"At N = {n:,}, the forward saves lse in float32 instead of P in float16 "
            f"({p_mib:,.0f} MiB per head). How many KiB per head does lse take?",
            answer=lse_kib, unit="KiB",
            explanation=f"One float32 per query row: {n:,} × {lse_bytes} bytes = {lse_kib:g} "
                        f"KiB, about {p_mib * KIB / lse_kib:,.0f}× less than P.",
            hint="lse has one number per query row; multiply by the bytes of a float32.",
            wrong_answers=(
                WrongAnswer(2 * lse_kib, "That keeps m and l separately; the course folds them "
                                         "into one number, lse = m + log l."),
                WrongAnswer(lse_kib / 2, "That is float16; lse is kept in float32 because it "
                                         "feeds an exp."),
            ),
        ),
        _move_answer(1, MultipleChoice(
            "dS = P ∘ (dP − D) needs D_i = Σ_j P_ij dP_ij per row. Why compute it as "
            "rowsum(dO ∘ O) in a preprocessing step?",
            choices=(
                "It is the same number from two N × d matrices, with no pass over P",
                "D is the row max, needed to recompute P",
                "D rescales dO so that the gradients do not overflow",
                "D is needed only with a causal mask",
            ),
            answer=0,
            explanations=(
                "Σ_j P_ij dP_ij = Σ_j P_ij (dO_i · v_j) = dO_i · o_i. Reading dO and O (N × d "
                "each) gives D before the tile loops, so no tile needs a whole row of P.",
                "The row statistics come from lse, saved by the forward; D is a different "
                "quantity, the softmax's correction term.",
                "D is not a scale factor: it is subtracted from dP because the softmax "
                "probabilities of a row sum to 1.",
                "D appears in every softmax gradient, masked or not.",
            ),
        )),
        Numeric(
            "The forward does two N × N × d matmuls (S, then P V); the backward does five "
            "(S again, dV, dP, dQ, dK). Counting matmul FLOPs, forward + backward is how many "
            "times the forward?",
            answer=fwd_bwd, unit="×",
            explanation=f"1 + 5/2 = {fwd_bwd:g}: the backward costs "
                        f"{costmodel.FA_BACKWARD_FLOP_RATIO:g}× the forward, the recomputation of "
                        f"S included. This is the convention behind the course's TFLOP/s figures.",
            hint="Count matmuls: forward 2, backward 5; express the total as a multiple of 2.",
            wrong_answers=(
                WrongAnswer(costmodel.FA_BACKWARD_FLOP_RATIO,
                            "That is the backward alone; add the forward's 1."),
                WrongAnswer(3, "The rule of thumb 'backward = 2× forward' is for ordinary "
                               "layers; attention's backward has five matmuls to the forward's "
                               "two."),
            ),
        ),
        _move_answer(2, MultipleChoice(
            "The one-pass backward adds each K/V tile's share of dQ into an fp32 buffer with "
            "atomic adds. Why can two runs on a GPU give dQ values that differ in the last bits?",
            choices=(
                "fp32 addition is not associative, and the adds arrive in a different order each run",
                "Atomic adds drop a contribution when two programs add to the same element at once",
                "The buffer is rounded to q's dtype after every add",
                "Each program visits its query tiles in a random order",
            ),
            answer=0,
            explanations=(
                "(a + b) + c and a + (b + c) can round differently. Which program adds to a dQ row "
                "first depends on how the GPU schedules them, so the sums differ in their last "
                "bits; deterministic=True keeps the two-kernel backward, whose dQ has one owner.",
                "An atomic add never loses a contribution: that is what atomic means. Every "
                "share is added; only the order changes.",
                "The buffer stays fp32 until every program is done; it is rounded once at the "
                "end.",
                "Each program walks its query tiles in a fixed order; what varies is the order "
                "in which different programs reach the same dQ row.",
            ),
        )),
    ]


# ---------------------------------------------------------------- 08: decoding, GQA, masks

def _chapter_08() -> list:
    mha = kvcache.MODELS[kvcache.DEFAULT_MODEL]
    seq_len = 4096
    cache_gib = kvcache.kv_cache_bytes(seq_len, layers=mha.layers, kv_heads=mha.n_kv_heads,
                                       head_dim=mha.head_dim, dtype="float16") / GIB
    gqa = next(m for m in kvcache.MODELS.values()
               if m.n_heads == mha.n_heads and 1 < m.n_kv_heads < m.n_heads)
    shrink = mha.kv_bytes(seq_len) / gqa.kv_bytes(seq_len)
    gpu = hardware.get_gpu("H100 SXM")
    return [
        Numeric(
            f"A model with {mha.layers} layers, {mha.n_kv_heads} K/V heads of dim "
            f"{mha.head_dim} (the Llama-2-7B shape) caches {seq_len:,} tokens in float16. "
            f"How many GiB is its KV cache?",
            answer=cache_gib, unit="GiB",
            explanation=f"2 (K and V) × {mha.layers} layers × {mha.n_kv_heads} heads × "
                        f"{mha.head_dim} × {seq_len:,} tokens × 2 bytes = {cache_gib:g} GiB, for "
                        f"one sequence. A batch of 32 needs {32 * cache_gib:g} GiB: the cache, "
                        f"not the weights, limits the batch.",
            hint="Multiply 2 (K and V) × layers × K/V heads × head dim × tokens × bytes per "
                 "element, then divide by 2³⁰.",
            wrong_answers=(
                WrongAnswer(cache_gib / 2, "That caches only K or only V; the cache holds both, "
                                           "the 2 in front of the formula."),
                WrongAnswer(cache_gib * 2, "That is float32 (4 bytes); the question says float16."),
                WrongAnswer(cache_gib / mha.layers, "That is one layer; every layer keeps its own "
                                                    "cache."),
            ),
        ),
        _move_answer(3, MultipleChoice(
            "Why is attention in a decoding step (one new token per sequence) memory-bound?",
            choices=(
                "Each cached K/V element read from HBM is used for about one multiply-add",
                "The KV cache is kept in CPU memory",
                "Each step recomputes attention for all earlier tokens",
                "Softmax over a long row costs more than the matmuls",
            ),
            answer=0,
            explanations=(
                "With a single query row, q·k and p·v touch every cached element once: about one "
                "FLOP per byte, against hundreds the GPU could do. The step takes as long as "
                "reading the cache.",
                "It is in GPU memory (HBM); even there, reading it dominates the step.",
                "The cache exists precisely to avoid that: earlier tokens' K and V are stored, "
                "and only the new query is attended.",
                "Softmax over one row is N scores, like each matmul; all of them are limited by "
                "reading the cache.",
            ),
        )),
        Numeric(
            f"GQA: {gqa.n_heads} query heads share {gqa.n_kv_heads} K/V heads (the "
            f"{gqa.name.split('(')[-1].rstrip(')')}). How many times smaller is its KV cache "
            f"than with {mha.n_heads} K/V heads, all else equal?",
            answer=shrink, unit="×",
            explanation=f"The cache scales with the number of K/V heads: {mha.n_heads} / "
                        f"{gqa.n_kv_heads} = {shrink:g}. Each K/V head serves a group of "
                        f"{gqa.group} query heads, so attention reads {shrink:g}× fewer bytes "
                        f"per step too.",
            hint="Only the K/V heads are cached; compare their numbers.",
            wrong_answers=(
                WrongAnswer(gqa.n_kv_heads, "That is the number of K/V heads, not the ratio of "
                                            "the two caches."),
                WrongAnswer(1 / shrink, "Inverted: the GQA cache is the smaller one, so the "
                                        "factor is above 1."),
            ),
        ),
        _move_answer(2, MultipleChoice(
            f"Flash-decoding splits the cached keys into chunks processed by different programs. "
            f"Why, at batch 1 on an {gpu.name} ({gpu.sm_count} SMs)?",
            choices=(
                "One program per (sequence, head) is too few to fill the SMs; chunks add programs",
                "Splitting reduces the FLOPs of the step",
                "Each chunk is an approximation that is cheaper to compute",
                "The merge step needs the chunks to be sorted by score",
            ),
            answer=0,
            explanations=(
                f"Batch 1 with {mha.n_heads} heads gives {mha.n_heads} programs for {gpu.sm_count} SMs, "
                f"most idle. "
                f"Splitting N into chunks gives more programs; their (m, l, o) states are merged "
                f"exactly, as in online softmax.",
                "The same scores and weighted sums are computed; only how the work is spread "
                "across the GPU changes (plus a small merge).",
                "Each chunk computes exact partial statistics, and merging rescales them to the "
                "common max: the result is exact.",
                "Merging is order-free: states rescale to the common max and add, in any order.",
            ),
        )),
    ]


# ---------------------------------------------------------------- 09: FlashAttention-3 on Hopper

def _chapter_09() -> list:
    from course_lib.attention import fp8  # torch: imported when the questions are built, not at import
    from course_lib.attention import fp_emulation
    from course_lib.measure import hopper_results

    gpu = hardware.get_gpu("H100 SXM")
    exp_tflops = hardware.H100_EXP_TFLOPS
    d = 128
    per_score = costmodel.attention_flops(1, 1, 1, d)  # the two matmuls' FLOPs per score: 4·d
    exp_share = (1 / exp_tflops) / (per_score / gpu.fp16_tflops)
    outlier = 100.0
    one_hot = np.zeros(d)
    one_hot[d // 3] = outlier
    rotation = fp8.random_rotation(d, seed=0).numpy()
    peak = float(np.abs(one_hot @ rotation).max())  # outlier / √d
    # FP32 instructions an SM issues in the time MUFU computes one exp2 (an FMA counts 2 FLOPs), and
    # the recorded speed of the Gluon forward with 1 in 4 exponentials emulated (chapter 09, section 8).
    fp32_per_exp = (gpu.fp32_tflops / 2) / exp_tflops
    emulated = hopper_results.load_fa4()["summary"]["speed"]["pingpong/128/exp2_emu_1of4"]
    return [
        _move_answer(2, MultipleChoice(
            "With TMA, a kernel loads a K tile by handing the copy engine a descriptor and the "
            "tile's coordinates. Why can FA3 then leave all loads to a few producer warps?",
            choices=(
                "The copy engine computes every address and copies asynchronously: one request",
                "TMA reads HBM faster, so fewer warps need to wait for it",
                "TMA converts tiles to FP8 on the way, halving the bytes to move",
                "The descriptor keeps all of K in shared memory, so nothing is left to load",
            ),
            answer=0,
            explanations=(
                "Without TMA every thread computes the addresses and masks of its elements and "
                "issues its loads, with the registers and instructions of the warps that do the "
                "math. A descriptor load is one request (base, shape, strides, block shape, "
                "coordinates); the tile lands in shared memory while the consumer warps compute "
                "on the previous one, so data movement overlaps computation.",
                "The bytes cross the same HBM at the same bandwidth. What changes is who spends "
                "instructions on them: the copy engine instead of every thread.",
                "TMA copies bytes as they are; FP8 is a separate choice (the inputs are quantized "
                "before the kernel runs).",
                f"Shared memory holds a few tiles ({gpu.max_shared_kib_per_sm} KiB per SM on an "
                f"{gpu.name}), not a K of thousands of rows: the producer streams tiles one after "
                f"another.",
            ),
        )),
        Numeric(
            f"An {gpu.name} multiplies FP16 matrices at {gpu.fp16_tflops:g} TFLOP/s but runs exp "
            f"at only {exp_tflops:g} TFLOP/s (FA3's figure; the memory-wall article's \"~4 TFLOPs\"). Per "
            f"score, the two matmuls do 4·d FLOPs and the softmax one exp. At d = {d}, how long "
            f"do the exps take, as a fraction of the matmuls' time?",
            answer=exp_share,
            explanation=f"exp: 1 / {exp_tflops:g} TFLOP/s per score; matmuls: {per_score:g} "
                        f"FLOPs / {gpu.fp16_tflops:g} TFLOP/s. The ratio is "
                        f"{gpu.fp16_tflops:g} / ({exp_tflops:g} × {per_score:g}) ≈ "
                        f"{exp_share:.2f}. One after the other, the tensor cores would idle "
                        f"{exp_share / (1 + exp_share):.0%} of the time; FA3's ping-pong runs one "
                        f"warpgroup's softmax while the other's matmuls run.",
            hint="Time is work divided by throughput: one exp per score at the exp rate, "
                 "4·d matmul FLOPs per score at the matmul rate. Divide the first by the second.",
            wrong_answers=(
                WrongAnswer(gpu.fp16_tflops / exp_tflops,
                            "That is the ratio of the throughputs; each score also needs 4·d "
                            "matmul FLOPs but only one exp."),
                WrongAnswer(1 / exp_share, "Inverted: that is the matmuls' time over the exps'."),
                WrongAnswer(2 * exp_share, "That counts one matmul (2·d FLOPs per score); "
                                           "attention has two, q·kᵀ and p·v."),
            ),
        ),
        _move_answer(1, MultipleChoice(
            "FA3 tests FP8 attention on inputs where 0.1 % of the entries are large outliers. "
            "Why does rotating q and k by a random Hadamard matrix before quantizing cut the "
            "error (2.6× in the reading)?",
            choices=(
                "Each outlier is spread evenly over all d columns, so no entry stands out",
                "The rotation makes the scores smaller, so softmax is less sensitive",
                "Rotated values are integers, which e4m3 stores exactly",
                "The rotation removes the outliers from q and k",
            ),
            answer=0,
            explanations=(
                "x @ R with R = diag(s) · H turns a one-hot outlier a into ±a/√d in every "
                "column: the rotated q and k look like well-behaved Gaussian data, which is "
                "FA3's rationale (\"incoherent processing\"). R is orthogonal, so the exact "
                "scores do not change: (qR)(kR)ᵀ = qkᵀ. Chapter 09 measures 1.6× less error with "
                "it (FA3: 2.6×), and no change on inputs without outliers.",
                "R is orthogonal: norms and scores are unchanged, (qR)(kR)ᵀ = q R Rᵀ kᵀ = qkᵀ. "
                "Only how each vector is spread over the columns changes.",
                "The entries of x @ R are sums of ±x_c/√d, not integers; e4m3 rounds them like "
                "any other value.",
                "Nothing is removed: R is invertible (R⁻¹ = Rᵀ). The outlier's energy is still "
                "there, spread over d columns instead of one.",
            ),
        )),
        Numeric(
            f"x has d = {d} entries, all zero except one outlier of {outlier:g}. After x @ R "
            f"with R = diag(s) · H (H the normalised Hadamard matrix, s random signs), what is "
            f"the largest |entry|?",
            answer=peak,
            explanation=f"The one-hot x picks one row of R: s_c times a row of H, whose entries "
                        f"are all ±1/√d. So every entry of x @ R is ±{outlier:g}/√{d} ≈ "
                        f"{peak:.2f}: the norm stays {outlier:g} (R is orthogonal), the peak "
                        f"drops by √d ≈ {math.sqrt(d):.1f}.",
            hint="A one-hot x times a matrix is one row of that matrix; what are the entries of "
                 "a normalised Hadamard matrix?",
            wrong_answers=(
                WrongAnswer(outlier / d, "That divides by d; the entries of the normalised H "
                                         "are ±1/√d, so that norms are kept."),
                WrongAnswer(outlier, "That is the outlier itself: the rotation spreads it over "
                                     "all d entries."),
                WrongAnswer(outlier * math.sqrt(d), "That uses the ±1 Hadamard matrix without "
                                                    "dividing by √d: not a rotation."),
            ),
        ),
        _move_answer(3, MultipleChoice(
            "FlashAttention-4 computes some of its exponentials with a polynomial on the FMA units "
            "and gains on a B200. Chapter 09 tried it in the Gluon forward on an H100: with 1 in 4 "
            f"exponentials emulated the kernel ran at {emulated['median_x_baseline']:.3f}× its speed "
            f"without (d = 128, median over {emulated['cells']} cells). Why does the trick pay on the "
            "B200 but not on the H100?",
            choices=(
                "B200 tensor cores outpace MUFU, so exp is its bottleneck; on the H100 it is not",
                "The H100 has no FMA units outside its tensor cores, so the polynomial runs slowly",
                "The B200's MUFU is slower than the H100's, so avoiding it pays more there",
                "On the H100 the cubic is too coarse for fp16, so the kernel redoes wrong exponentials",
            ),
            answer=0,
            explanations=(
                f"An {gpu.name} SM issues {fp32_per_exp:.1f} FP32 instructions in the time its MUFU "
                f"computes one exp2, and one emulated exp2 costs about that many (the clamp, the "
                f"floor, the fraction, {fp_emulation.EXP2_POLY_DEGREE} FMAs, the exponent add): a "
                f"draw at best. The softmax already keeps those issue slots busy, while ping-pong "
                f"hides MUFU's time under the other warpgroup's products, so the extra instructions "
                f"lengthen the longer path. On a B200 the products of a score take half as long, the "
                f"exponentials become the bottleneck, and FA4's softmax warps have slots to spare.",
                f"The {gpu.name} has FP32 units beside its tensor cores ({gpu.fp32_tflops:g} TFLOP/s); "
                f"the polynomial runs there. The trick did what it says: fewer ex2.approx in the PTX, "
                f"{fp_emulation.EXP2_POLY_DEGREE} FMAs for each one removed.",
                "MUFU's rate per SM is about the same on both. What changed is the tensor cores: "
                "faster products leave the exponentials exposed on the B200.",
                "Nothing is repeated: every exponential is computed once. After p is rounded to bf16 "
                "or fp16 the cubic is within 1 ulp; it hurt lse (summed in fp32), not speed.",
            ),
        )),
        _move_answer(0, MultipleChoice(
            "Chapter 09's Gluon forward tried two ways to run exponentials while the tensor cores "
            "work: one warpgroup leaving its P·V product running during its own softmax "
            "(\"overlap\"), and two consumer warpgroups taking turns (\"ping-pong\"). On the "
            "H100 only ping-pong beat the Triton kernel. Why does it hide more?",
            choices=(
                "During one warpgroup's softmax the other's products keep the tensor cores busy",
                "Ping-pong computes half as many exponentials, one per pair of warpgroups",
                "Ping-pong runs the exponentials on the tensor cores",
                "Ping-pong loads K and V with TMA, the overlap design with pointer loads",
            ),
            answer=0,
            explanations=(
                "In the overlap design the same warps must finish their softmax, rescale O and "
                "convert P before they can queue the next products, so the tensor cores wait in "
                "between. With two warpgroups passing a turn barrier, one queues its products and "
                "hands over; its softmax then runs under the other's matmuls (1.07–1.14× the "
                "Triton kernel, against 0.90–0.97× for the overlap design).",
                "Every score still needs its exponential; the two warpgroups split the rows, not "
                "the work per row.",
                "Exponentials run on the special-function units in both designs; the tensor cores "
                "only multiply matrices. What changes is whether they have a product queued "
                "meanwhile.",
                "Every design of the Gluon kernel loads K and V by TMA into the same rings.",
            ),
        )),
    ]


# ---------------------------------------------------------------- 11: ring attention

def _chapter_11() -> list:
    from course_lib.integrations import ring  # imports torch: only when chapter 11's questions are built

    n_local, heads, d, world = 8192, 32, 128, 8
    bf16 = costmodel.bytes_per_element("bfloat16")
    kv_mib = ring.step_bytes(1, heads, n_local, d, bf16)["kv"] / MIB
    gpu = hardware.get_gpu("H100 SXM")
    flops = gpu.peak_flops("bfloat16") / 2
    threshold = ring.hide_threshold(flops, ring.NVLINK_H100_BYTES_PER_S, bf16)
    contiguous = ring.ring_efficiency(ring.causal_work(world, "contiguous", n=64 * world))
    return [
        _move_answer(1, MultipleChoice(
            f"A ring of {world} ranks: every step each rank sends the K/V shard it holds to rank "
            f"r + 1. Whose shard does rank 5 hold at step 3?",
            choices=(
                "Rank 2's: after s hops rank r holds rank (r − s) mod W's shard",
                "Rank 0's: (5 + 3) mod 8",
                "Rank 3's: the step number",
                "Its own: ranks keep their K/V and send their queries instead",
            ),
            answer=0,
            explanations=(
                "Each hop moves a shard from r − 1 to r, so after 3 hops rank 5 holds what rank "
                "5 − 3 = 2 started with.",
                "That is the shard travelling the other way; in this ring rank r receives from "
                "r − 1, so the source is r − s.",
                "The step counts hops, not ranks: only rank 3 at step 0 (or rank r at step r − 3) "
                "holds rank 3's shard.",
                "Sending queries instead would work too (and some systems do), but this ring keeps "
                "each rank's queries and output in place and moves K and V.",
            ),
        )),
        Numeric(
            f"Each rank holds {n_local:,} tokens of a sequence; {heads} heads of dim {d} in "
            f"bfloat16. How many MiB does one rank send per forward step?",
            answer=kv_mib, unit="MiB",
            explanation=f"K and V: 2 × {heads} heads × {n_local:,} tokens × {d} × {bf16} bytes "
                        f"= {kv_mib:g} MiB, against 4 × {heads} × {n_local:,}² × {d} FLOPs of "
                        f"compute: bytes grow like n, FLOPs like n².",
            hint="The shard in flight is K and V of this rank's tokens: 2 × heads × tokens × d × "
                 "bytes per element, then divide by 2²⁰.",
            wrong_answers=(
                WrongAnswer(kv_mib / 2, "That is K or V alone; both travel."),
                WrongAnswer(kv_mib * 2, "That counts 4 bytes per element; bfloat16 has 2."),
            ),
        ),
        Numeric(
            f"An {gpu.name} runs attention at half its bf16 peak ({flops / 1e12:.0f} TFLOP/s) and "
            f"sends over NVLink at {ring.NVLINK_H100_BYTES_PER_S / 1e9:.0f} GB/s each way. Above how "
            f"many tokens per rank does a forward step's compute outlast its K/V transfer?",
            answer=threshold, unit="tokens",
            explanation=f"Per head, compute 4·n²·d / F against transfer 2·n·d·2 bytes / BW: equal "
                        f"at n = F / BW = {threshold:,.0f} tokens. Above it the next shard arrives "
                        f"before the current block is done, so the transfer is hidden.",
            hint="Set 4·n²·d / FLOPs-per-second equal to 2·n·d·(2 bytes) / bytes-per-second and "
                 "solve for n.",
            wrong_answers=(
                WrongAnswer(threshold * 2, "That uses the full peak; the question says half of it."),
                WrongAnswer(threshold / 2, "That counts K or V only, or 1 byte per element."),
            ),
        ),
        _move_answer(2, MultipleChoice(
            f"With a causal mask and {world} ranks holding contiguous shards, the ring runs at "
            f"about {contiguous:.0%} efficiency. Why, and what does the zig-zag split change?",
            choices=(
                "Early ranks see few keys and idle each step; zig-zag gives each an early and a late chunk",
                "The last rank sends more bytes; zig-zag sends fewer",
                "The causal mask makes the merge slower; zig-zag skips the merge",
                "Contiguous shards need more steps than zig-zag shards",
            ),
            answer=0,
            explanations=(
                "Rank 0's queries see only its own keys, the last rank's see all of them; each step "
                "waits for the busiest rank. Chunks r and 2W − 1 − r give every rank the same "
                "number of visible pairs.",
                "Every rank sends its shard's K/V each step whatever the mask; the imbalance is in "
                "compute, not bytes.",
                "The merge costs the same per row; what differs is how many pairs each rank "
                "computes.",
                "Both take W steps: every rank must see every shard once (or skip it).",
            ),
        )),
        _move_answer(3, MultipleChoice(
            "In the backward ring, what does each rank need to compute its share of the gradient "
            "of a K/V block it holds?",
            choices=(
                "Its q, o, dO and the lse of the merged output over all keys",
                "The lse of that block alone, recomputed",
                "The other ranks' queries",
                "The full N × N probability matrix, gathered once",
            ),
            answer=0,
            explanations=(
                "P = exp(S − lse) with the global lse is that block's slice of the true softmax, "
                "and D = rowsum(dO ∘ O) uses the merged o: chapter 07's kernels then give exactly "
                "this block's contribution to dQ, dK and dV.",
                "A block's own lse would renormalise its probabilities as if it held all the keys: "
                "the gradients would be wrong.",
                "No: the dK/dV accumulators travel with the K/V shard and each rank adds its own "
                "queries' share.",
                "That is what FlashAttention avoids: probabilities are rebuilt tile by tile from the "
                "lse.",
            ),
        )),
    ]


# ---------------------------------------------------------------- 10: masks as tile rules

def _chapter_10() -> list:
    from course_lib.attention import masks  # noqa: PLC0415 - only this chapter's questions need it

    n, window, block = 65_536, 4096, 128
    counts = masks.tile_counts(masks.sliding_window_tile_classes(n, n, window, block, block))
    visited_pct = 100 * (counts["partial"] + counts["full"]) / counts["total"]
    # The hint's estimate, W / BLOCK_N + 1 tiles of each row's N / BLOCK_N, counts every Q tile
    # as a full band; the exact count is a little lower (the first Q tiles have fewer keys
    # before them). Both reasonings are right: the tolerance takes both numbers.
    band_tiles = window // block + 1
    estimate_pct = 100 * band_tiles / (n // block)
    band_tol = abs(estimate_pct - visited_pct) / visited_pct + DEFAULT_REL_TOL / 2
    lengths, n_max = (900, 200, 4096), 4096
    padded_tiles = len(lengths) * iomodel.num_blocks(n_max, block) ** 2
    packed_tiles = sum(iomodel.num_blocks(n_b, block) ** 2 for n_b in lengths)
    saved = padded_tiles / packed_tiles
    return [
        Numeric(
            f"A one-sided sliding window of W = {window:,} (each query sees itself and the "
            f"{window - 1:,} keys before it, none after) over N = {n:,} tokens, tiles of {block} "
            f"× {block}. What percentage of the (Q tile, K/V tile) pairs does a kernel that "
            f"visits only the non-empty tiles compute?",
            answer=visited_pct, unit="%", rel_tol=band_tol,
            explanation=f"Each Q tile visits about W / BLOCK_N + 1 = {band_tiles} K/V tiles of "
                        f"the {n // block} in its row, {estimate_pct:.2f}%; counted exactly (the "
                        f"first Q tiles have fewer keys before them) "
                        f"{counts['partial'] + counts['full']:,} of {counts['total']:,} tiles, "
                        f"{visited_pct:.2f}%. Its time is that fraction of dense attention's, "
                        f"whatever the partial tiles cost extra.",
            hint="Count the tiles in the band of one Q tile, about W / BLOCK_N + 1, and divide by "
                 "the tiles of a row, N / BLOCK_N.",
            wrong_answers=(
                WrongAnswer(100 - visited_pct, "That is the share of tiles skipped, not "
                                               "computed."),
                WrongAnswer(50.0, "That is causal attention; the window skips every tile older "
                                  "than W too."),
            ),
        ),
        _move_answer(1, MultipleChoice(
            "Why does the kernel apply the element mask on partial tiles only?",
            choices=(
                "On a full tile every entry is visible: masking changes nothing, it only costs time",
                "Full tiles do not need the online softmax",
                "Applying the mask on a full tile would give wrong results",
                "Triton cannot load a mask inside a loop",
            ),
            answer=0,
            explanations=(
                "A full tile's mask is all True. Skipping it saves the mask's work (a load or "
                "index arithmetic, and a select per score) on most tiles.",
                "Every visited tile goes through the same online-softmax update.",
                "It would give the same result, only slower: masking a full tile hides nothing.",
                "It can: the partial tiles load it inside the loop.",
            ),
        )),
        Numeric(
            f"A batch of sequences of {', '.join(map(str, lengths))} tokens, non-causal, tiles of "
            f"{block}. Padded to {n_max:,}, how many times more tiles does a kernel compute than "
            f"a varlen kernel on the packed batch?",
            answer=saved, unit="×",
            explanation=f"Padded: {len(lengths)} × {iomodel.num_blocks(n_max, block)}² = "
                        f"{padded_tiles:,} tiles. Packed, each sequence only its own: "
                        f"{' + '.join(f'{iomodel.num_blocks(x, block)}²' for x in lengths)} = "
                        f"{packed_tiles:,}: {saved:.2f}× fewer. A padded kernel that knows each "
                        f"sample's length skips the same tiles.",
            hint="Count ceil(n / 128)² tiles per sequence, with n its own length or the padded "
                 "one.",
            wrong_answers=(
                WrongAnswer(len(lengths) * n_max / sum(lengths),
                            "That is the ratio of tokens; attention's work grows with the square "
                            "of each sequence's length."),
            ),
        ),
        _move_answer(2, MultipleChoice(
            "With GQA (H query heads, H_kv K/V heads), what is dK for one K/V head?",
            choices=(
                "The sum of the dK of the H / H_kv query heads that read it",
                "The dK of the first query head of its group",
                "The mean of the group's dK",
                "Zero: K/V heads are shared, so they get no gradient",
            ),
            answer=0,
            explanations=(
                "The K/V head is used by every query head of its group, so its gradient adds up "
                "the contributions of all of them (as for any tensor used more than once).",
                "Every query head of the group used this K, so every one contributes.",
                "A mean would divide by the group size: the forward used K that many times, each "
                "use adds its full gradient.",
                "Shared parameters get the sum of the gradients of their uses, not zero.",
            ),
        )),
    ]


# ---------------------------------------------------------------- 12: your kernel in a real model

def _chapter_12() -> list:
    tokens, heads = 16_384, 16
    bf16 = costmodel.bytes_per_element("bfloat16")
    weights_gib = heads * tokens * tokens * bf16 / GIB
    q_heads, kv_heads, head = 16, 4, 6
    return [
        _move_answer(1, MultipleChoice(
            "torch.compile(fullgraph=True) fails on a model whose attention launches a Triton "
            "kernel from Python. What does registering the kernel as a torch.library custom op "
            "with a fake implementation give the compiler?",
            choices=(
                "One opaque node whose output shapes, dtypes and strides it knows without running "
                "it",
                "A faster kernel: the fake is a cheap approximation used while training",
                "The kernel's source, so that Inductor can fuse it with its neighbours",
                "Nothing for the forward pass: custom ops only matter for the backward",
            ),
            answer=0,
            explanations=(
                "Right: the compiler records a call to the op as one node and never looks inside; "
                "while tracing it runs the fake on FakeTensors (no data) to learn what the node "
                "returns, and the registered autograd formula tells it the backward.",
                "The fake never computes anything: it only returns empty tensors of the right "
                "shape, dtype and strides. The real kernel runs whenever the graph runs.",
                "That is triton_op with wrap_triton; a custom_op stays opaque to the compiler.",
                "The forward is where the graph broke: Dynamo could not trace the launch. The "
                "op fixes both passes (the backward through register_autograd).",
            ),
        )),
        _move_answer(2, MultipleChoice(
            "A decoding step with a KV cache: 1 new query against 100 cached keys. What does "
            "causal=True (SDPA's is_causal, aligned to the top-left) compute for that query?",
            choices=(
                "Attention over key 0 only: wrong, the new token must see all 100 keys",
                "Attention over all 100 keys, as it should",
                "Attention over the last key only, the token itself",
                "An error: causal attention needs as many queries as keys",
            ),
            answer=0,
            explanations=(
                "Right: top-left alignment lets query i see keys j <= i, so query 0 sees key 0. "
                "The new token is the last position, so its mask is aligned to the bottom-right: "
                "with N_q = 1 that is no mask at all (causal=False).",
                "That is what the step needs, and what causal=False (or a bottom-right mask) "
                "gives; top-left causal gives something else.",
                "Nothing aligns the single query with the last key: top-left causal pairs it with "
                "key 0.",
                "SDPA and flash_attention accept N_q != N_k with causal=True; the mask is then "
                "aligned to the top-left corner, which is the trap.",
            ),
        )),
        Numeric(
            f"transformers' 'eager' attention materialises the attention weights of every head. "
            f"At T = {tokens:,} tokens and {heads} query heads in bfloat16 ({bf16} bytes), how "
            f"many GiB do one sequence's weights take in one layer?",
            answer=weights_gib, unit="GiB",
            explanation=f"H · T² = {heads} × {tokens:,}² = {heads * tokens * tokens:,} weights "
                        f"× {bf16} bytes = {weights_gib:g} GiB per layer and sequence — kept for "
                        f"the backward in every layer. A tiled kernel keeps one log-sum-exp per "
                        f"row instead.",
            hint="Count the T × T weights of each query head, times the bytes per element, and "
                 "divide by 2³⁰.",
            wrong_answers=(
                WrongAnswer(2 * weights_gib, "That counts 4 bytes per weight (float32); the "
                                             "question is about bfloat16."),
                WrongAnswer(weights_gib / heads, "That is one head; every query head has its own "
                                                 "T × T weights."),
                WrongAnswer(weights_gib / 2, "GQA shares the K/V heads, not the weights: every "
                                             "query head still has its own T × T weights."),
            ),
        ),
        _move_answer(3, MultipleChoice(
            f"A layer has {q_heads} query heads and {kv_heads} K/V heads (GQA). Which K/V head "
            f"does query head {head} read?",
            choices=(
                f"K/V head {head // (q_heads // kv_heads)}: h // (H / H_kv)",
                f"K/V head {head % kv_heads}: h mod H_kv",
                f"K/V head {head}: heads are matched one to one",
                "All of them, averaged",
            ),
            answer=0,
            explanations=(
                f"Right: consecutive query heads share a K/V head, {q_heads // kv_heads} per group; "
                f"repeat_interleave makes the same pairing when it copies the K/V heads.",
                "That pairing is what repeat (tiling) makes, and what exercise 12.1's check calls "
                "K/V heads repeated in the wrong order.",
                f"There are only {kv_heads} K/V heads: head {head} does not exist among them.",
                "Each query head reads exactly one K/V head; sharing saves the cache, nothing is "
                "averaged.",
            ),
        )),
    ]


_BUILDERS: dict[str, Callable[[], list]] = {
    "01": _chapter_01, "02": _chapter_02, "03": _chapter_03, "04": _chapter_04,
    "05": _chapter_05, "06": _chapter_06, "07": _chapter_07, "08": _chapter_08,
    "09": _chapter_09, "10": _chapter_10, "11": _chapter_11, "12": _chapter_12,
}
CHAPTERS = tuple(_BUILDERS)  # "01" … "09"


def questions(chapter: str) -> list:
    """The concept-check questions of ``chapter`` (``"01"`` … ``"09"``), built now.

    Raises ValueError naming ``chapter`` and listing the chapters that have questions.
    """
    if chapter not in _BUILDERS:
        raise ValueError(f"chapter must be one of {', '.join(CHAPTERS)}, got {chapter!r}")
    return _BUILDERS[chapter]()


def all_questions() -> dict[str, list]:
    """``{"01": [...], ..., "09": [...]}``: every chapter's questions."""
    return {chapter: questions(chapter) for chapter in CHAPTERS}
