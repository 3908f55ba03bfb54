"""MLA KV prolog stage 2 as one PyPTO kernel: kv_b projection, k_nope/value split, RoPE on k_pe.

For T tokens, with L = kv_lora_rank, N heads, P = qk_nope_head_dim, V = v_head_dim, R = rope dim::

    kv       = normed_ckv [T, L] @ kv_b_weight[N*(P+V), L].T       (output in the input dtype)
    k_nope   = kv.view(T, N, P+V)[..., :P]                          -> [T, N, P]
    value    = kv.view(T, N, P+V)[..., P:]                          -> [T, N, V]
    x0, x1   = k_pe[:, 0::2], k_pe[:, 1::2]     (rotation pairs (x[2i], x[2i+1]))
    o0       = x0*cos - x1*sin,  o1 = x0*sin + x1*cos               (fp32; cos/sin [T, R/2] fp32)
    k_pe_rot = interleaved: out[2i] = o0[i], out[2i+1] = o1[i]      (transformers' apply_rotary_emb)
               half:        out[i]  = o0[i], out[i+R/2]  = o1[i]    (hub apply_rotary_pos_emb,
                                                                     torch_npu.npu_interleave_rope)
    each output cast to the input dtype.

Kernel design (chosen by simulated-time exploration, see benchmarks/pypto_tiling.md):

* T is dynamic: ``pypto.loop`` over token tiles of ``tile_t`` rows, ``valid_shape`` for the tail tile.
  Head dimensions are static and taken from the tensor shapes (nothing is hard-coded).
* kv_b: one ``pypto.matmul(x_tile, W_rows.T)`` per head and per half (k_nope rows, value rows of
  ``kv_b_weight``, read in place in nn.Linear layout with ``b_trans=True``), each assembled straight
  into its output. No reshape and no vector copy of the [T, N*(P+V)] product is needed, and with
  ``cube_nbuffer_setting={-1: 2}`` the 2N cube sub-graphs run as N tasks in a single wave.
* RoPE needs even/odd pair access. The host passes free views ``k_pe.view(T, 1, R/2, 2)`` and
  ``cos.view(T, 1, R/2, 1)``, so the pairs are two strided ``pypto.view``s (last index 0 / 1) and the
  rotated halves are assembled into ``k_pe_rot.view(T, 1, R/2, 2)`` (interleaved) or
  ``k_pe_rot.view(T, 2, R/2, 1)`` (half). All element-wise, in fp32, in 8-row vector tiles (with 16-row tiles
  pypto splits the RoPE into two levels), so one level of vector
  tasks runs in parallel with the cube tasks -- no transpose, reshape or permutation matmul (those were measured
  at 1.5-3x the simulated time). ``Stage2Config(rope_impl="permute")`` keeps the exact
  permutation-matmul variant as a verified fallback (see the config's docstring).

Modes: ``mode="sim"`` runs on CPU tensors through :mod:`mla_ops.pypto_runtime` (pass verification on,
outputs computed by pypto's calculator, simulated Ascend 910B2 time recorded in
``mla_ops.pypto_runtime.last_result()``); ``mode="npu"`` compiles the same kernel body with ``RunMode.NPU`` for
torch_npu tensors: outputs are allocated on the input's device, nothing synchronises with the host.
Each (dims, dtype, layout, mode, config) variant is built once per process; pypto's SIM path
recompiles on every call by design (about a second), the NPU path compiles once.
"""

# No `from __future__ import annotations` here: pypto.frontend.jit reads the kernel's parameter
# annotations as live pypto.Tensor objects, not strings.
import dataclasses
import functools
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ... import pypto_runtime as runtime
from ..._checks import HALF_DTYPES, INTERLEAVED_INPUT_LAYOUTS

__all__ = [
    "DEFAULT_STAGE2_CONFIG",
    "INTERLEAVED_INPUT_LAYOUTS",
    "Stage2Config",
    "kv_prolog_stage2",
    "kv_prolog_stage2_not_supported_reasons",
]

ROPE_IMPLS = ("strided", "permute")


@dataclasses.dataclass(frozen=True)
class Stage2Config:
    """Tiling / scheduling knobs of the stage-2 kernel (all verified configurations give identical
    outputs; they differ in simulated time only).

    tile_t:         token rows per loop iteration (the matmul M tile; the tail uses valid_shape).
    cube_tiles:     ``set_cube_tile_shapes(m, k, n)`` as ((mL0, mL1), (kL0, kL1), (nL0, nL1)).
                    L0A/L0B hold mL0*kL0 / kL0*nL0 16-bit values in 64 KB each.
    unroll_list:    None -> ``pypto.loop``; else ``pypto.loop_unroll(unroll_list=...)`` over tiles.
    cube_nbuffer:   ``cube_nbuffer_setting={-1: n}`` (merge n isomorphic cube sub-graphs per task);
                    None leaves pypto's default (no merge).
    cube_l1_reuse:  ``cube_l1_reuse_setting={-1: n}``; None leaves pypto's default (automatic).
    rope_tile_last: last vector tile dim of the RoPE sub-graph (elements; 32-byte aligned for bf16).
    rope_tile_t:    token rows of the RoPE sub-graph's vector tile (at most ``tile_t``). 8, half the token
                    tile: with 16 rows pypto partitions the RoPE into two dependent levels (a 16-row
                    tile of the padded pair views is 16 KiB; with its temporaries, likely more than
                    the unified buffer holds)
                    (8.03 µs at T=1 against 6.79 with 8 rows, the time of the kv_b part alone).
    valid_shape_optimize: runtime option (static main tile, dynamic tail).
    rope_impl:      how the kernel reaches the rotation pairs. "strided" (default): element-wise on
                    strided pair views of a free ``[T, 1, R/2, 2]`` host view. "permute": an exact 0/1
                    permutation matmul de-interleaves ``[T, R]`` into [evens | odds] (and a second one
                    re-interleaves the interleaved layout) -- slower in the simulation (T=1: 12.4 µs
                    half / 21.5 µs interleaved against 6.8), kept as the verified fallback should an
                    NPU toolchain reject the last-dim-1 pair views.
    """

    name: str = "default"
    tile_t: int = 16
    cube_tiles: Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]] = ((16, 16), (128, 512), (128, 256))
    unroll_list: Optional[Tuple[int, ...]] = None
    cube_nbuffer: Optional[int] = 2
    cube_l1_reuse: Optional[int] = None
    rope_tile_last: int = 16
    rope_tile_t: int = 8
    valid_shape_optimize: bool = False
    rope_impl: str = "strided"

    def pass_options(self) -> Dict[str, Dict[int, int]]:
        opts = {}
        if self.cube_nbuffer is not None:
            opts["cube_nbuffer_setting"] = {-1: self.cube_nbuffer}
        if self.cube_l1_reuse is not None:
            opts["cube_l1_reuse_setting"] = {-1: self.cube_l1_reuse}
        return opts

    def runtime_options(self) -> Dict[str, int]:
        return {"valid_shape_optimize": 1} if self.valid_shape_optimize else {}


DEFAULT_STAGE2_CONFIG = Stage2Config()


@dataclasses.dataclass(frozen=True)
class _Dims:
    L: int     # kv_lora_rank
    N: int     # heads
    P: int     # qk_nope_head_dim
    V: int     # v_head_dim
    R: int     # rope dim


# ----------------------------------------------------------------------------------------------
# validation (no host sync: shapes, dtypes, devices only)
# ----------------------------------------------------------------------------------------------
def kv_prolog_stage2_not_supported_reasons(normed_ckv, k_pe, kv_b_weight, cos, sin, *, num_heads: int,
                                           qk_nope_head_dim: int, v_head_dim: int,
                                           rope_layout: str = "interleaved", mode: str = "sim") -> List[str]:
    """Why :func:`kv_prolog_stage2` cannot run these inputs (empty list = supported).

    Checks availability (pypto 0.2.0), mode, layout, dtypes, ranks, shapes, devices and contiguity of
    the weight; never reads tensor values.
    """
    availability = list(runtime.unavailable_reasons())   # reported along with, not instead of, input problems
    reasons: List[str] = []
    if mode not in runtime.MODES:
        reasons.append(f"mode must be one of {runtime.MODES}, got {mode!r}")
    if rope_layout not in INTERLEAVED_INPUT_LAYOUTS:
        reasons.append(f"rope_layout {rope_layout!r}: the kernel rotates adjacent pairs "
                       f"({' or '.join(INTERLEAVED_INPUT_LAYOUTS)})")
    dims = {"num_heads": num_heads, "qk_nope_head_dim": qk_nope_head_dim, "v_head_dim": v_head_dim}
    for name, v in dims.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            reasons.append(f"{name} must be a positive int, got {v!r}")
    tensors = {"normed_ckv": normed_ckv, "k_pe": k_pe, "kv_b_weight": kv_b_weight, "cos": cos, "sin": sin}
    not_tensors = [n for n, t in tensors.items() if not isinstance(t, torch.Tensor)]
    if not_tensors:
        return availability + reasons + [f"{', '.join(not_tensors)} must be torch.Tensor"]

    # dtypes
    if normed_ckv.dtype not in HALF_DTYPES:
        reasons.append(f"normed_ckv dtype must be float16 or bfloat16 (the PyPTO kernel has no fp32 "
                       f"variant), got {normed_ckv.dtype}")
    for name in ("k_pe", "kv_b_weight"):
        if tensors[name].dtype != normed_ckv.dtype:
            reasons.append(f"{name} dtype {tensors[name].dtype} must equal normed_ckv dtype "
                           f"{normed_ckv.dtype}")
    for name in ("cos", "sin"):
        if tensors[name].dtype != torch.float32:
            reasons.append(f"{name} must be float32 (one value per rotation pair), got {tensors[name].dtype}")
    # ranks and shapes
    for name, t in tensors.items():
        if t.dim() != 2:
            reasons.append(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if reasons:
        return availability + reasons
    T, L = normed_ckv.shape
    R = k_pe.shape[1]
    rows = num_heads * (qk_nope_head_dim + v_head_dim)
    if k_pe.shape[0] != T:
        reasons.append(f"k_pe has {k_pe.shape[0]} tokens, normed_ckv has {T}")
    if R % 2:
        reasons.append(f"k_pe's rope dim must be even (rotation pairs), got {R}")
    if tuple(kv_b_weight.shape) != (rows, L):
        reasons.append(f"kv_b_weight must be [num_heads*(qk_nope_head_dim+v_head_dim), kv_lora_rank] = "
                       f"[{rows}, {L}] (nn.Linear layout), got {list(kv_b_weight.shape)}")
    for name in ("cos", "sin"):
        if tuple(tensors[name].shape) != (T, R // 2):
            reasons.append(f"{name} must be [T, R/2] = [{T}, {R // 2}], got {list(tensors[name].shape)}")
    if not kv_b_weight.is_contiguous():
        reasons.append("kv_b_weight must be contiguous (it is read in place; a per-call copy is not made)")
    reasons += runtime.device_reasons(tensors, mode, normed_ckv)
    return availability + reasons


# ----------------------------------------------------------------------------------------------
# the kernel
# ----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _build_kernel(dims: _Dims, dtype: torch.dtype, rope_layout: str, mode: str, config: Stage2Config):
    """Build (once per process and variant) the jit kernel. Arguments (see :func:`_kernel_args`):
    ckv [T,L], w [N*(P+V),L], k_pe, cos, sin, k_nope [T,N*P], value [T,N*V], k_pe_out (+ perm), with
    rope_impl "strided": k_pe [T,1,R/2,2], cos/sin [T,1,R/2,1], k_pe_out [T,1,R/2,2] (interleaved)
    or [T,2,R/2,1] (half); "permute": k_pe [T,R], cos/sin [T,R/2], k_pe_out [T,R], perm [R,R]."""
    if config.rope_impl not in ROPE_IMPLS:
        raise ValueError(f"Stage2Config.rope_impl must be one of {ROPE_IMPLS}, got {config.rope_impl!r}")
    runtime.ensure_supported()
    import pypto

    L, N, P, V, R = dims.L, dims.N, dims.P, dims.V, dims.R
    H, R2 = P + V, R // 2
    TT = config.tile_t
    dt = runtime.pypto_dtype(dtype)
    f32 = pypto.DT_FP32
    DYN = pypto.DYNAMIC
    cube_m, cube_k, cube_n = (list(x) for x in config.cube_tiles)
    use_unroll = config.unroll_list is not None
    unroll = list(config.unroll_list or (1,))
    rope_last = config.rope_tile_last
    rope_rows = min(config.rope_tile_t, TT)
    interleaved = rope_layout == "interleaved"
    strided = config.rope_impl == "strided"
    pe_in_shape, cs_shape = ([DYN, 1, R2, 2], [DYN, 1, R2, 1]) if strided else ([DYN, R], [DYN, R2])
    pe_out_shape = ([DYN, 1, R2, 2] if interleaved else [DYN, 2, R2, 1]) if strided else [DYN, R]
    # Strided: o1 goes to the odd slot of each pair (interleaved) or to the second half (half).
    o1_at_pair_slot = 1 if interleaved else 0
    o1_at_half = 0 if interleaved else 1
    # Rank-2 verdict tolerance (tensor_graph vs goldens): 1 ulp of the output dtype, see tests.
    eps = torch.finfo(dtype).eps
    jit = runtime.jit_kwargs(mode, error_tol=(eps, 1e-5), runtime_options=config.runtime_options(),
                         pass_options=config.pass_options())

    @pypto.frontend.function
    def _rope_strided(kpe, cos, sin, kpe_out, off, valid):
        # fp32 on the pair views: x[2i] at last index 0, x[2i+1] at last index 1.
        pypto.set_vec_tile_shapes(rope_rows, 1, R2, rope_last)
        x0 = pypto.cast(pypto.view(kpe, [TT, 1, R2, 1], [off, 0, 0, 0], valid_shape=[valid, 1, R2, 1]), f32)
        x1 = pypto.cast(pypto.view(kpe, [TT, 1, R2, 1], [off, 0, 0, 1], valid_shape=[valid, 1, R2, 1]), f32)
        c = pypto.view(cos, [TT, 1, R2, 1], [off, 0, 0, 0], valid_shape=[valid, 1, R2, 1])
        s = pypto.view(sin, [TT, 1, R2, 1], [off, 0, 0, 0], valid_shape=[valid, 1, R2, 1])
        o0 = pypto.cast(pypto.sub(pypto.mul(x0, c), pypto.mul(x1, s)), dt)
        o1 = pypto.cast(pypto.add(pypto.mul(x0, s), pypto.mul(x1, c)), dt)
        pypto.assemble(o0, [off, 0, 0, 0], kpe_out)
        pypto.assemble(o1, [off, o1_at_half, 0, o1_at_pair_slot], kpe_out)

    @pypto.frontend.function
    def _rope_permute(kpe, cos, sin, kpe_out, perm, off, valid):
        # x @ perm = [evens | odds] exactly (one 1 per column, fp32 accumulation of zeros).
        pypto.set_cube_tile_shapes([16, 16], [R, R], [R, R])
        x = pypto.view(kpe, [TT, R], [off, 0], valid_shape=[valid, R])
        xd = pypto.matmul(x, perm, f32)
        pypto.set_vec_tile_shapes(TT, R2)
        x0 = pypto.view(xd, [TT, R2], [0, 0], valid_shape=[valid, R2])
        x1 = pypto.view(xd, [TT, R2], [0, R2], valid_shape=[valid, R2])
        c = pypto.view(cos, [TT, R2], [off, 0], valid_shape=[valid, R2])
        s = pypto.view(sin, [TT, R2], [off, 0], valid_shape=[valid, R2])
        o0 = pypto.cast(pypto.sub(pypto.mul(x0, c), pypto.mul(x1, s)), dt)
        o1 = pypto.cast(pypto.add(pypto.mul(x0, s), pypto.mul(x1, c)), dt)
        if interleaved:
            pypto.set_vec_tile_shapes(TT, R)
            halves = pypto.view(pypto.concat([o0, o1], 1), [TT, R], [0, 0], valid_shape=[valid, R])
            # [o0 | o1] @ perm.T puts o0[i] at 2i and o1[i] at 2i+1, exactly.
            out = pypto.matmul(halves, perm, dt, b_trans=True)
            pypto.assemble(pypto.view(out, [TT, R], [0, 0], valid_shape=[valid, R]), [off, 0], kpe_out)
        else:
            pypto.assemble(o0, [off, 0], kpe_out)
            pypto.assemble(o1, [off, R2], kpe_out)

    @pypto.frontend.function
    def _tile(ckv, w, kpe, cos, sin, k_nope, value, kpe_out, perm, t, off):
        valid = pypto.min(t - off, TT)
        # kv_b: per head, k_nope rows and value rows of the nn.Linear weight, transposed in the cube.
        pypto.set_cube_tile_shapes(cube_m, cube_k, cube_n)
        x = pypto.view(ckv, [TT, L], [off, 0], valid_shape=[valid, L])
        for h in range(N):
            w_nope = pypto.view(w, [P, L], [h * H, 0])
            w_val = pypto.view(w, [V, L], [h * H + P, 0])
            pypto.assemble(pypto.matmul(x, w_nope, dt, b_trans=True), [off, h * P], k_nope)
            pypto.assemble(pypto.matmul(x, w_val, dt, b_trans=True), [off, h * V], value)
        if strided:
            _rope_strided(kpe, cos, sin, kpe_out, off, valid)
        else:
            _rope_permute(kpe, cos, sin, kpe_out, perm, off, valid)

    @pypto.frontend.function
    def _loop(ckv, w, kpe, cos, sin, k_nope, value, kpe_out, perm):
        t = ckv.shape[0]
        n_tiles = (t + TT - 1) // TT
        if use_unroll:
            for t_idx, k in pypto.loop_unroll(0, n_tiles, 1, name="LOOP_T", idx_name="t_idx",
                                              unroll_list=unroll):
                for u in range(k):
                    _tile(ckv, w, kpe, cos, sin, k_nope, value, kpe_out, perm, t, (t_idx + u) * TT)
        else:
            for t_idx in pypto.loop(n_tiles, name="LOOP_T", idx_name="t_idx"):
                _tile(ckv, w, kpe, cos, sin, k_nope, value, kpe_out, perm, t, t_idx * TT)

    # pypto.frontend.jit compiles from the annotated signature, so the two argument lists (with and
    # without the permutation matrix) are two decorated functions around one shared body.
    if strided:
        @pypto.frontend.jit(**jit)
        def mla_kv_prolog_stage2(
            ckv: pypto.Tensor([DYN, L], dt),
            w: pypto.Tensor([N * H, L], dt),
            kpe: pypto.Tensor(pe_in_shape, dt),
            cos: pypto.Tensor(cs_shape, f32),
            sin: pypto.Tensor(cs_shape, f32),
            k_nope: pypto.Tensor([DYN, N * P], dt),
            value: pypto.Tensor([DYN, N * V], dt),
            kpe_out: pypto.Tensor(pe_out_shape, dt),
        ):
            _loop(ckv, w, kpe, cos, sin, k_nope, value, kpe_out, None)
    else:
        @pypto.frontend.jit(**jit)
        def mla_kv_prolog_stage2(
            ckv: pypto.Tensor([DYN, L], dt),
            w: pypto.Tensor([N * H, L], dt),
            kpe: pypto.Tensor(pe_in_shape, dt),
            cos: pypto.Tensor(cs_shape, f32),
            sin: pypto.Tensor(cs_shape, f32),
            k_nope: pypto.Tensor([DYN, N * P], dt),
            value: pypto.Tensor([DYN, N * V], dt),
            kpe_out: pypto.Tensor(pe_out_shape, dt),
            perm: pypto.Tensor([R, R], dt),
        ):
            _loop(ckv, w, kpe, cos, sin, k_nope, value, kpe_out, perm)

    return mla_kv_prolog_stage2


@functools.lru_cache(maxsize=None)
def _deinterleave_matrix(rope_dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """[R, R] 0/1 matrix P with (x @ P) = [x[0::2] | x[1::2]] (built once per dtype and device)."""
    half = rope_dim // 2
    perm = torch.zeros(rope_dim, rope_dim, dtype=dtype)
    perm[torch.arange(0, rope_dim, 2), torch.arange(half)] = 1
    perm[torch.arange(1, rope_dim, 2), torch.arange(half, rope_dim)] = 1
    return perm.to(device)


def _kernel_args(normed_ckv, k_pe, kv_b_weight, cos, sin, k_nope, value, k_pe_rot, rope_layout, config):
    """The kernel's arguments: free views of the callers' tensors (``contiguous()`` is a no-op for
    contiguous inputs, a device copy otherwise -- never a host sync)."""
    T, R = k_pe.shape
    R2 = R // 2
    args = [normed_ckv.contiguous(), kv_b_weight]
    if config.rope_impl == "strided":
        pe_view = (T, 1, R2, 2) if rope_layout == "interleaved" else (T, 2, R2, 1)
        args += [k_pe.contiguous().view(T, 1, R2, 2), cos.contiguous().view(T, 1, R2, 1),
                 sin.contiguous().view(T, 1, R2, 1)]
    else:
        pe_view = (T, R)
        args += [k_pe.contiguous(), cos.contiguous(), sin.contiguous()]
    args += [k_nope.view(T, -1), value.view(T, -1), k_pe_rot.view(pe_view)]
    if config.rope_impl == "permute":
        args.append(_deinterleave_matrix(R, k_pe.dtype, str(k_pe.device)))
    return args, pe_view


def run_with_result(normed_ckv, k_pe, kv_b_weight, cos, sin, *, num_heads: int, qk_nope_head_dim: int,
                    v_head_dim: int, rope_layout: str = "interleaved", mode: str = "sim",
                    config: Stage2Config = DEFAULT_STAGE2_CONFIG, goldens: Optional[Sequence[torch.Tensor]] = None
                    ) -> Tuple[Tuple[torch.Tensor, torch.Tensor, torch.Tensor], Optional[runtime.SimResult]]:
    """:func:`kv_prolog_stage2` plus the SimResult (mode="sim"); ``goldens`` = optional
    (k_nope [T,N,P], value [T,N,V], k_pe_rot [T,R]) compared by pypto's verifier (tensor_graph)."""
    reasons = kv_prolog_stage2_not_supported_reasons(
        normed_ckv, k_pe, kv_b_weight, cos, sin, num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
        v_head_dim=v_head_dim, rope_layout=rope_layout, mode=mode)
    if reasons:
        raise ValueError("kv_prolog_stage2: " + "; ".join(reasons))
    T, L = normed_ckv.shape
    R = k_pe.shape[1]
    N, P, V = num_heads, qk_nope_head_dim, v_head_dim
    dtype, device = normed_ckv.dtype, normed_ckv.device
    k_nope = torch.empty(T, N, P, dtype=dtype, device=device)
    value = torch.empty(T, N, V, dtype=dtype, device=device)
    k_pe_rot = torch.empty(T, R, dtype=dtype, device=device)
    if T == 0:
        return (k_nope, value, k_pe_rot), None
    kernel = _build_kernel(_Dims(L=L, N=N, P=P, V=V, R=R), dtype, rope_layout, mode, config)
    args, pe_view = _kernel_args(normed_ckv, k_pe, kv_b_weight, cos, sin, k_nope, value, k_pe_rot,
                                 rope_layout, config)
    kernel_goldens = None
    if goldens is not None:
        g_nope, g_value, g_pe = goldens
        kernel_goldens = [None] * 5 + [g_nope.reshape(T, N * P), g_value.reshape(T, N * V),
                                       g_pe.reshape(pe_view)] + [None] * (len(args) - 8)
    result = runtime.launch("kv_prolog_stage2", kernel, args, mode=mode, goldens=kernel_goldens,
                        outputs={"k_nope": k_nope, "value": value, "k_pe_rot": k_pe_rot})
    return (k_nope, value, k_pe_rot), result


def kv_prolog_stage2(normed_ckv: torch.Tensor, k_pe: torch.Tensor, kv_b_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, *, num_heads: int, qk_nope_head_dim: int,
                     v_head_dim: int, rope_layout: str = "interleaved", mode: str = "sim"
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA KV prolog stage 2 on the PyPTO kernel.

    Args:
        normed_ckv:  [T, L] fp16/bf16, the RMS-normed compressed kv.
        k_pe:        [T, R] same dtype, un-rotated.
        kv_b_weight: [N*(P+V), L] same dtype, nn.Linear layout (the module's weight, read in place).
        cos, sin:    [T, R/2] fp32, one value per rotation pair (freqs_cis.real / .imag).
        rope_layout: "interleaved" (out[2i], out[2i+1]) or "half" (out[i], out[i+R/2]).
        mode:        "sim" (CPU tensors, pypto SIM + pass verification; raises SimVerificationError
                     on a FAILED verdict) or "npu" (torch_npu tensors, asynchronous).

    Returns:
        (k_nope [T, N, P], value [T, N, V], k_pe_rot [T, R]), contiguous, in the input dtype.

    Raises:
        ValueError: unsupported inputs (see :func:`kv_prolog_stage2_not_supported_reasons`).
    """
    outputs, _ = run_with_result(normed_ckv, k_pe, kv_b_weight, cos, sin, num_heads=num_heads,
                                 qk_nope_head_dim=qk_nope_head_dim, v_head_dim=v_head_dim,
                                 rope_layout=rope_layout, mode=mode)
    return outputs
