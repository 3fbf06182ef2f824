"""A probe of one HYLA kernel design on paper: the head-coupled products chained in registers.

Not a library path: a forward-only Triton kernel (``rms_head`` × ``mlp_relu``/``mlp_linear``, no
mask or bias, lengths a multiple of 16) written to measure, in the sm_90a compile report, the one
cost the design's analysis could not count: the register-layout changes that build its operands
from the scores (barrier-separated stages per key tile). Formulas: :mod:`primal_dual.kernels.
hyla.blockwise`.

The design. Flash attention hands its first product's accumulator ``[M, N]`` to the second
product as the ``A`` operand ``[M, K = N]`` without leaving registers. HYLA's two products that
couple the heads (``z_ij = Σ_g a_gij v_gj``, ``out_hi = Σ_j a_hij u_ij``) can be chained the same way
with the value column ``d`` as ``M``: for a group of S queries × S keys of a 16 × 16 tile,
``zᵀ[d, (i, j)] = Vᵀ[d, (h, j′)] · B1[(h, j′), (i, j)]`` with ``B1 = a_hij δ(j, j′)``, then
``outᵀ[d, (i, h)] += relu(zᵀ)[d, (i′, j)] · B2[(i′, j), (i, h)]`` with ``B2 = a_hij δ(i, i′)``.
The block-diagonal operands waste a factor S of each product's FLOPs (S = 4: ``K`` and ``N`` reach
16, a matrix instruction's least), but ``u`` never changes layout; the 16 groups of a tile are the
batch of two 3-D ``tl.dot``. What it costs instead: ``B1`` and ``B2`` are permutations of the score
tile, which the compiler builds through shared memory (``tl.permute``/``tl.reshape``), once per key
tile.

  python -m tools.device.hyla_chain_probe --out-dir benchmarks/results   # compile report (sm_90a)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import triton
import triton.language as tl

TILE = 16  # queries and keys per tile (a matrix instruction's least M/N/K)
GROUP = 4  # queries (and keys) per block-diagonal group: GROUP² = 16 = the products' K and N
RMS_EPS = 1e-6


@triton.jit
def chain_forward(q_ptr, k_ptr, v_ptr, out_ptr, scale, N: tl.constexpr, H: tl.constexpr,
                  D: tl.constexpr, DV: tl.constexpr, DC: tl.constexpr, RELU: tl.constexpr,
                  EPS: tl.constexpr):  # fmt: skip
  """One program: 16 queries × value columns ``[c·DC, (c+1)·DC)`` of one example.

  ``q, k [B, N, H, D]``, ``v [B, N, H, DV]`` (bfloat16), ``out [B, N, H, DV]`` (float32).
  """
  S: tl.constexpr = 4  # GROUP
  G: tl.constexpr = 4  # groups per tile side: TILE // GROUP
  BT: tl.constexpr = 16  # TILE
  b = tl.program_id(0)
  q0 = tl.program_id(1) * BT
  c0 = tl.program_id(2) * DC
  h = tl.arange(0, H)
  row = tl.arange(0, BT)
  feature = tl.arange(0, D)
  q = tl.load(q_ptr + ((b * N + q0 + row[None, :, None]) * H + h[:, None, None]) * D
              + feature[None, None, :])  # fmt: skip
  # Vᵀ of a key group, laid out as the first product's A operand [(ig, jg), d, (h, j′)]:
  # batch (ig, jg) → key group jg; column (h, j′) → head h, key jg·S + j′.
  batch = tl.arange(0, G * G)
  column = tl.arange(0, H * S)
  value = tl.arange(0, DC)
  v_key = (batch % G)[:, None, None] * S + (column % S)[None, None, :]
  v_offset = (column // S)[None, None, :] * DV + c0 + value[None, :, None]
  eye = tl.arange(0, S)[:, None] == tl.arange(0, S)[None, :]
  out = tl.zeros([G, DC, S * H], dtype=tl.float32)  # [ig, d, (i, h)]
  for k0 in range(0, N, BT):
    k = tl.load(k_ptr + ((b * N + k0 + row[None, None, :]) * H + h[:, None, None]) * D
                + feature[None, :, None])  # fmt: skip
    s = tl.dot(q, k) * scale  # [H, i, j], float32
    r = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + EPS)
    a = tl.reshape(s * r[None, :, :], [H, G, S, G, S])  # [h, ig, i, jg, j]
    b1 = tl.reshape(tl.permute(a, (1, 3, 0, 2, 4)), [G, G, H, 1, S, S])  # [ig, jg, h, ·, i, j]
    b1 = tl.where(tl.reshape(eye, [1, 1, 1, S, 1, S]), b1, 0.0)  # [ig, jg, h, j′, i, j]
    b1 = tl.reshape(b1, [G * G, H * S, S * S]).to(tl.bfloat16)
    vt = tl.load(v_ptr + (b * N + k0 + v_key) * H * DV + v_offset)  # [(ig, jg), d, (h, j′)]
    z = tl.dot(vt, b1)  # [(ig, jg), d, (i, j)]
    if RELU:
      z = tl.maximum(z, 0.0)
    b2 = tl.reshape(tl.permute(a, (1, 3, 4, 2, 0)), [G, G, 1, S, S, H])  # [ig, jg, ·, j, i, h]
    b2 = tl.where(tl.reshape(eye, [1, 1, S, 1, S, 1]), b2, 0.0)  # [ig, jg, i′, j, i, h]
    b2 = tl.reshape(b2, [G * G, S * S, S * H]).to(tl.bfloat16)
    o = tl.dot(z.to(tl.bfloat16), b2)  # [(ig, jg), d, (i, h)]
    out += tl.sum(tl.reshape(o, [G, G, DC, S * H]), axis=1)
  # out[ig, d, (i, h)] → out[b, q0 + ig·S + i, h, c0 + d]
  group = tl.arange(0, G)[:, None, None]
  ih = tl.arange(0, S * H)[None, None, :]
  query = q0 + group * S + ih // H
  tl.store(out_ptr + ((b * N + query) * H + ih % H) * DV + c0 + value[None, :, None], out)


def constants(length: int, heads: int, head_dim: int, value_dim: int, chunk: int, relu: bool):
  return dict(N=length, H=heads, D=head_dim, DV=value_dim, DC=chunk, RELU=relu, EPS=RMS_EPS)


def run_interpreted(q, k, v, chunk: int, relu: bool) -> np.ndarray:
  """The kernel's own source in Triton's interpreter (float32 inputs rounded to bfloat16)."""
  import torch

  from primal_dual.kernels import triton_interpreter

  batch, length, heads, head_dim = q.shape
  value_dim = v.shape[-1]
  if length % TILE or value_dim % chunk:
    raise ValueError(f"length {length} and value_dim {value_dim} need multiples of 16 and {chunk}")
  args = [torch.tensor(np.asarray(x, np.float32)).to(torch.bfloat16) for x in (q, k, v)]
  out = torch.zeros((batch, length, heads, value_dim), dtype=torch.float32)
  grid = (batch, length // TILE, value_dim // chunk)
  # Triton's library interpreted and its bfloat16 faults mended, as for the library's kernels.
  scale = 1.0 / math.sqrt(head_dim)
  consts = constants(length, heads, head_dim, value_dim, chunk, relu)
  triton_interpreter.run(chain_forward, grid, [*args, out, scale], consts)
  return out.numpy()


def compile_report(out_dir: Path, length: int = 8192, chunks=(16, 32), warps=(4, 8)) -> Path:
  """Compiles the probe for sm_90a at H = 8, d = 64 (bfloat16) for each value chunk and warp count;
  writes ``hyla_chain_probe.json`` and ``.md`` (registers, spills, shared memory, per key-tile
  SASS counts, the time estimate of ``tools/device/gpu_compile.py``)."""
  import tempfile

  from tools.device import gpu_compile as gc

  records = []
  heads, head_dim = 8, 64
  for chunk in chunks:
    for num_warps in warps:
      source = dict(
        module=__name__,
        function="chain_forward",
        constants=constants(length, heads, head_dim, head_dim, chunk, True),
        signature={
          "q_ptr": "*bf16",
          "k_ptr": "*bf16",
          "v_ptr": "*bf16",
          "out_ptr": "*fp32",
          "scale": "fp32",
        },  # fmt: skip
      )
      launch = gc.LaunchShape(
        programs=length // TILE * (head_dim // chunk), iterations=length / TILE, inner_trips=1
      )
      job = gc.CompileJob(f"chain_c{chunk}_w{num_warps}", source, num_warps, 1, launch._asdict())
      with tempfile.TemporaryDirectory() as workdir:
        record = gc.compile_kernel(job, Path(workdir), memory_cap_gib=12, timeout_s=900)
      records.append({"value_chunk": chunk, "num_warps": num_warps, **record})
      print(json.dumps({k: record.get(k) for k in ("status", "registers", "estimate_ms")}))
  out_dir.mkdir(parents=True, exist_ok=True)
  (out_dir / "hyla_chain_probe.json").write_text(json.dumps(records, indent=1))
  lines = [
    "# HYLA chained-products probe: sm_90a compile report (forward only)",
    "",
    f"`python -m tools.device.hyla_chain_probe`; H = 8, d = d_v = 64, bfloat16, N = {length}, one "
    "example; estimate: `tools/device/gpu_compile.py`'s model (not a measurement).",
    "",
    "| value chunk | warps | status | registers | spill bytes | shared KiB | HMMA / key tile | "
    "barriers / key tile | instructions / key tile | programs per SM | estimate ms |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in records:
    if r["status"] != "ok":
      lines.append(f"| {r['value_chunk']} | {r['num_warps']} | {r['status']}: {r['reason']} |")
      continue
    it = r["sass_iteration"]
    spills = r["spill_store_bytes"] + r["spill_load_bytes"]
    lines.append(
      f"| {r['value_chunk']} | {r['num_warps']} | ok | {r['registers']} | {spills} | "
      f"{r['shared_bytes'] / 1024:.1f} | {it.get('hmma', 0)} | {it['barrier']} | "
      f"{it['instructions']} | {r['programs_per_sm']} | {r['estimate_ms']:.1f} |"
    )
  path = out_dir / "hyla_chain_probe.md"
  path.write_text("\n".join(lines) + "\n")
  return path


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
  parser.add_argument("--length", type=int, default=8192)
  args = parser.parse_args(argv)
  print(compile_report(args.out_dir, args.length))


if __name__ == "__main__":
  main()
