"""6. lora: the multi-LoRA kernels (`orca_backend.lora.kernel`: shrink and expand, each row its
slot) against a float64 reference on a fused q|k|v-shaped projection with 8 slots, rows of
every slot and of the base model mixed, per dtype; then their time beside the batched-product
path the CPU uses (`LoRABatch` without the kernels), at decode batch sizes."""
from __future__ import annotations

from tools.gpu_check.kernel_sections import median_microseconds
from tools.gpu_check.report import Context, attempt, say, sync

TOLERANCES = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}
NUM_SLOTS, RANK = 8, 16


def shapes(ctx: Context) -> tuple[int, int, tuple[int, ...]]:
    """(hidden, fused q|k|v width, row counts): Llama-3-8B's on a GPU, tiny in the dry run."""
    if ctx.cuda:
        return 4096, 4096 + 2 * 1024, (1, 32, 256)
    return 64, 96, (5,)


def make_stack(ctx: Context, dtype_name: str, hidden: int, width: int):
    import torch

    from orca_backend.lora import LoRAProjection, LoRAStack

    quarter = (width - hidden) // 2
    projection = LoRAProjection("out", (("q_proj", slice(None), hidden), ("k_proj", slice(None), quarter),
                                        ("v_proj", slice(None), quarter)), hidden, width)
    stack = LoRAStack(projection, NUM_SLOTS, RANK, getattr(torch, dtype_name), ctx.device)
    g = torch.Generator(device="cpu").manual_seed(0)
    stack.a.copy_(torch.randn(stack.a.shape, generator=g) / hidden ** 0.5)
    for b in stack.b:  # the blocks only: the rest of B stays zero, as an adapter leaves it
        b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    stack.targeted[:] = [True] * NUM_SLOTS
    return stack


def row_layout(num_rows: int) -> list[tuple[int | None, int]]:
    """One row per request, slots round-robin with a base-model row every ninth."""
    return [(None if i % 9 == 8 else i % NUM_SLOTS, 1) for i in range(num_rows)]


def lora(ctx: Context, rec: dict) -> None:
    hidden, width, row_counts = shapes(ctx)
    rec["tables"]["kernels against float64"] = []
    rec["tables"]["median microseconds per projection"] = []
    for dtype_name in ctx.sizes.dtypes:
        for rows in row_counts:
            attempt(ctx, rec, f"{dtype_name}/{rows}", numerics, ctx, rec, dtype_name, hidden, width, rows)
    if ctx.cuda:
        for rows in row_counts:
            attempt(ctx, rec, f"time/{rows}", timing, ctx, rec, hidden, width, rows)
    ctx.report.save()
    rec["notes"].append("pass: every |error| <= tolerance * (1 + |reference|); rows of the base model unchanged")


def numerics(ctx: Context, rec: dict, dtype_name: str, hidden: int, width: int, rows: int) -> None:
    import torch

    from orca_backend.lora import LoRABatch

    stack = make_stack(ctx, dtype_name, hidden, width)
    layout = row_layout(rows)
    g = torch.Generator(device="cpu").manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(ctx.device, stack.a.dtype)
    y = torch.randn(rows, width, generator=g).to(ctx.device, stack.a.dtype)
    want = y.double().clone()
    for i, (slot, _) in enumerate(layout):
        if slot is not None:
            want[i] += (x[i].double() @ stack.a[slot].double()) @ stack.b_full[slot].double()
    got = LoRABatch({(0, "qkv"): stack}, layout, ctx.device, kernel=True).add(y.clone(), x, 0, "qkv")
    sync(ctx)
    diff, tol = (got.double() - want).abs(), TOLERANCES[dtype_name]
    base_rows = [i for i, (slot, _) in enumerate(layout) if slot is None]
    ok = bool((diff <= tol * (1 + want.abs())).all()) and bool((got[base_rows] == y[base_rows]).all())
    rec["checks"][f"{dtype_name}/{rows}"] = ok
    rec["tables"]["kernels against float64"].append({
        "dtype": dtype_name, "rows": rows, "hidden": hidden, "width": width, "slots": NUM_SLOTS, "rank": RANK,
        "max_abs_error": diff.max().item(), "tolerance": tol, "pass": ok})
    say(f"lora: {dtype_name}/{rows}: error {diff.max().item():.3g}")


def timing(ctx: Context, rec: dict, hidden: int, width: int, rows: int) -> None:
    import torch

    from orca_backend.lora import LoRABatch

    stack = make_stack(ctx, "bfloat16", hidden, width)
    layout = row_layout(rows)
    x = torch.randn(rows, hidden, device=ctx.device, dtype=torch.bfloat16)
    y = torch.zeros(rows, width, device=ctx.device, dtype=torch.bfloat16)
    row = {"rows": rows}
    for name, kernel in (("kernels_us", True), ("batched_products_us", False)):
        batch = LoRABatch({(0, "qkv"): stack}, layout, ctx.device, kernel=kernel)
        row[name] = median_microseconds(ctx, lambda: batch.add(y, x, 0, "qkv"), ctx.sizes.reps)
    base = torch.randn(width, hidden, device=ctx.device, dtype=torch.bfloat16)
    row["base_projection_us"] = median_microseconds(ctx, lambda: x @ base.T, ctx.sizes.reps)
    rec["tables"]["median microseconds per projection"].append(row)
    say(f"lora: time at {rows} rows: {row}")
