#!/usr/bin/env python3
"""Peer benchmark for bnb8 (DESIGN.md §10): times the optimizers and block-wise
quantization of PyTorch, bitsandbytes, FlashOptim and torchao on the device GPU.

Runs on the device with the carried, unpacked wheels on PYTHONPATH:

    export PYTHONPATH=$PWD/.whl/site:$PYTHONPATH; PYTHONUNBUFFERED=1 python3 dev/bench/peers/bench_peers.py

Method: CUDA events around each repetition, 5 warm-up calls, median of >= 20
repetitions, buffers far larger than the 50 MB L2, random data (never zeros),
the first step (lazy states, torch.compile, autotuning) timed apart and given in
the row's note,
and the device-to-device copy bandwidth of a 2 GiB buffer (bytes read + written)
measured in the same run.  Reports ms per 1e9 parameters, GB/s (bytes per element
as DESIGN.md §10 counts them) and % of the copy bandwidth.  Each peer runs in
try/except: a failure prints "peer X: not run (reason)" and the script goes on.
If the environment variable OUT is set, the rows are also written to $OUT/peers.csv.
PEERS="torchao flash" times only those groups (torch, bnb, flash, torchao; default all).

Uses only the standard library, torch, and the carried packages (bitsandbytes,
flashoptim, torchao).  Peers' code is never committed: see README.md beside this file.
"""

import csv
import datetime
import gc
import math
import os
import statistics
import sys
import time

T_START = time.time()

import torch  # noqa: E402

# 'packaging' is needed by bitsandbytes; it is normally installed on the device.
# A copy is carried in .whl/fallback and used only when it is missing (appended
# after site-packages, so it never shadows the installed one).
try:
    import packaging  # noqa: F401  # pyflakes: unused on purpose
except ImportError:
    _fb = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".whl", "fallback")
    sys.path.append(os.path.normpath(_fb))

WARMUP = 5
MIN_REPS = 20
OPT_TARGET_S = 1.0      # wall time aimed at for the timed repetitions of one optimizer case
OPT_MAX_REPS = 100
KERNEL_TARGET_S = 0.5   # same, for copy / quantize / dequantize
KERNEL_MAX_REPS = 200

N_ONE = 1 << 28          # one tensor of 2^28 elements
COPY_ELEMS = 1 << 29     # fp32 -> 2 GiB buffer
QUANT_ELEMS = 1 << 28
QUANT_BLOCK = 4096

# bytes moved per element, as DESIGN.md §10 counts them
BPE_8BIT = 16.0    # fp32 p r/w 8 + g 4 + m r/w 2 + v r/w 2
BPE_32BIT = 28.0   # fp32 p r/w 8 + g 4 + m r/w 8 + v r/w 8
BPE_FLASH = 12.25  # bf16 p r/w 4 + bf16 g 2 + ecc r/w 2 + m r/w 2 + v r/w 2 + scales 0.25
BPE_QUANT = 5.0    # fp32 in 4 + u8 out 1 (or the reverse)
# torchao, bf16 p and g, no master: bf16 p r/w 4 + g 2, m and v codes r/w, an fp32 scale per block and state r/w
BPE_AO_8BIT = 10.0625  # codes r/w 4 + scales 2 x 8 / 256 (blocks of 256)
BPE_AO_4BIT = 8.125    # 4-bit codes r/w 2 + scales 2 x 8 / 128 (blocks of 128)


def gpt2xl_shapes():
    """GPT-2 XL's 580 tensors (1,557,686,400 parameters)."""
    d, v, t, L = 1600, 50304, 1024, 48
    shapes = [(v, d), (t, d)]
    for _ in range(L):
        shapes += [
            (d,), (d,),              # ln_1.w, ln_1.b
            (3 * d, d), (3 * d,),    # attn.qkv.w, attn.qkv.b
            (d, d), (d,),            # attn.proj.w, attn.proj.b
            (d,), (d,),              # ln_2.w, ln_2.b
            (4 * d, d), (4 * d,),    # mlp.fc.w, mlp.fc.b
            (d, 4 * d), (d,),        # mlp.proj.w, mlp.proj.b
        ]
    shapes += [(d,), (d,)]           # ln_f.w, ln_f.b
    return shapes


LAYOUTS = {
    "one-2^28": [(N_ONE,)],
    "gpt2xl-580": gpt2xl_shapes(),
}


def numel(shapes):
    return sum(math.prod(s) for s in shapes)


assert len(LAYOUTS["gpt2xl-580"]) == 580
assert numel(LAYOUTS["gpt2xl-580"]) == 1_557_686_400

DEV = torch.device("cuda")
ROWS = []        # dicts for the final table / CSV
COPY = {"gbps": None}


def log(msg):
    print(msg, flush=True)


def free():
    gc.collect()
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001  (a sticky CUDA error from a peer: report, go on)
        log(f"  free(): {type(e).__name__}: {e}")


def time_cuda(fn, target_s, max_reps):
    """Warm-up, then median/min of per-repetition CUDA-event times (ms)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    # one timed call to choose the number of repetitions
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    est = max(s.elapsed_time(e), 1e-3)
    reps = int(max(MIN_REPS, min(max_reps, math.ceil(target_s * 1e3 / est))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for i in range(reps):
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    ts = [a.elapsed_time(b) for a, b in zip(starts, ends)]
    return statistics.median(ts), min(ts), reps


def add_row(name, layout, n, ms, ms_min, reps, bpe, note=""):
    gbps = bpe * n / (ms * 1e-3) / 1e9
    row = {
        "name": name,
        "layout": layout,
        "n": n,
        "reps": reps,
        "ms_median": ms,
        "ms_min": ms_min,
        "ms_per_1e9": ms * 1e9 / n,
        "bytes_per_elem": bpe,
        "gbps": gbps,
        "pct_copy": None,
        "note": note,
    }
    ROWS.append(row)
    log(f"  {name:<24} {layout:<11} n={n:>13,d} reps={reps:>3}  median {ms:9.3f} ms  min {ms_min:9.3f} ms"
        f"  -> {row['ms_per_1e9']:8.2f} ms/1e9  {gbps:7.0f} GB/s  {note}")


def not_run(name, layout, reason):
    reason = " ".join(str(reason).split())[:300]
    log(f"peer {name} [{layout}]: not run ({reason})")
    ROWS.append({"name": name, "layout": layout, "n": "", "reps": "", "ms_median": None, "ms_min": None,
                 "ms_per_1e9": None, "bytes_per_elem": "", "gbps": None, "pct_copy": None,
                 "note": "not run: " + reason})


# ----------------------------------------------------------------------------- copy

def bench_copy(tag):
    src = torch.empty(COPY_ELEMS, device=DEV, dtype=torch.float32).uniform_(-1.0, 1.0)
    dst = torch.empty_like(src)
    ms, ms_min, reps = time_cuda(lambda: dst.copy_(src), KERNEL_TARGET_S, KERNEL_MAX_REPS)
    nbytes = 2 * src.numel() * src.element_size()
    gbps = nbytes / (ms * 1e-3) / 1e9
    log(f"  copy ({tag}): {nbytes / 2**30:.0f} GiB moved (read + write), reps={reps}, median {ms:.3f} ms,"
        f" min {ms_min:.3f} ms -> {gbps:.0f} GB/s")
    return gbps  # src, dst are freed on return


# ----------------------------------------------------------------------------- optimizers

def make_params(shapes, dtype):
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s, device=DEV, dtype=dtype).normal_(0.0, 0.02))
        p.grad = torch.empty_like(p).normal_(0.0, 1e-3)
        params.append(p)
    return params


def first_step_s(opt):
    """Wall seconds of an optimizer's first step: its states made, and its compile (torch.compile)
    or autotuning where it has one; the timed steps come after it."""
    torch.cuda.synchronize()
    t0 = time.time()
    opt.step()
    torch.cuda.synchronize()
    return time.time() - t0


def opt_case(name, layout, dtype, ctor, bpe, note_fn=None):
    """One optimizer on one layout; everything it allocates is freed on return."""
    shapes = LAYOUTS[layout]
    n = numel(shapes)
    params = opt = None
    try:
        torch.cuda.reset_peak_memory_stats()
        params = make_params(shapes, dtype)
        opt = ctor(params)
        first_s = first_step_s(opt)
        ms, ms_min, reps = time_cuda(opt.step, OPT_TARGET_S, OPT_MAX_REPS)
        note = note_fn(opt, params) if note_fn else ""  # after the steps: states are made lazily
        note = (note + " " if note else "") + f"first step {first_s:.1f} s"
        finite = all(bool(torch.isfinite(params[i]).all()) for i in (0, len(params) // 2, len(params) - 1))
        peak = torch.cuda.max_memory_allocated() / 2**30
        note = (note + " " if note else "") + f"peak {peak:.1f} GiB" + ("" if finite else " NON-FINITE PARAMS")
        add_row(name, layout, n, ms, ms_min, reps, bpe, note)
    except Exception as e:  # noqa: BLE001
        not_run(name, layout, f"{type(e).__name__}: {e}")
    params = opt = None  # noqa: F841  (drop the references before emptying the cache)
    free()


def run_torch_fused():
    log("torch.optim.AdamW(fused=True), fp32 params + grads")
    for layout in LAYOUTS:
        opt_case("torch AdamW fused", layout, torch.float32,
                 lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), BPE_32BIT)


def import_bnb():
    import bitsandbytes as bnb
    import bitsandbytes.functional  # noqa: F401
    import bitsandbytes.optim  # noqa: F401
    return bnb


def run_bnb():
    try:
        bnb = import_bnb()
        try:
            from bitsandbytes.cextension import lib as _lib
            libpath = getattr(_lib.__dict__.get("_lib"), "_name", "") or type(_lib).__name__
        except Exception as e:  # noqa: BLE001
            libpath = f"? ({type(e).__name__}: {e})"
        log(f"bitsandbytes {bnb.__version__} from {os.path.dirname(bnb.__file__)}; native library: {libpath}")
    except Exception as e:  # noqa: BLE001
        reason = f"import bitsandbytes failed: {type(e).__name__}: {e}"
        for name in ("bnb AdamW8bit", "bnb AdamW 32-bit"):
            for layout in LAYOUTS:
                not_run(name, layout, reason)
        not_run("bnb quantize_blockwise", "one-2^28", reason)
        not_run("bnb dequantize_blockwise", "one-2^28", reason)
        return

    log("bitsandbytes.optim.AdamW8bit (block-wise, defaults: lr 1e-3, wd 1e-2, min_8bit_size 4096), fp32 params + grads")
    for layout in LAYOUTS:
        opt_case("bnb AdamW8bit", layout, torch.float32,
                 lambda ps: bnb.optim.AdamW8bit(ps), BPE_8BIT)

    log("bitsandbytes.optim.AdamW(optim_bits=32), fp32 params + grads")
    for layout in LAYOUTS:
        opt_case("bnb AdamW 32-bit", layout, torch.float32,
                 lambda ps: bnb.optim.AdamW(ps, optim_bits=32), BPE_32BIT)

    log(f"bitsandbytes.functional.quantize_blockwise / dequantize_blockwise, fp32, blocksize {QUANT_BLOCK}")
    for fn in (bench_bnb_quantize, bench_bnb_dequantize):
        try:
            fn(bnb.functional)
        except Exception as e:  # noqa: BLE001
            not_run("bnb " + fn.__name__[len("bench_bnb_"):] + "_blockwise", "one-2^28", f"{type(e).__name__}: {e}")
        free()


def bench_bnb_quantize(F):
    n = QUANT_ELEMS
    a = torch.randn(n, device=DEV, dtype=torch.float32)
    ms, ms_min, reps = time_cuda(lambda: F.quantize_blockwise(a, blocksize=QUANT_BLOCK),
                                 KERNEL_TARGET_S, KERNEL_MAX_REPS)
    add_row("bnb quantize_blockwise", "one-2^28", n, ms, ms_min, reps, BPE_QUANT, "fp32 -> u8, block 4096")


def bench_bnb_dequantize(F):
    n = QUANT_ELEMS
    a = torch.randn(n, device=DEV, dtype=torch.float32)
    q, st = F.quantize_blockwise(a, blocksize=QUANT_BLOCK)
    out = torch.empty_like(a)
    ms, ms_min, reps = time_cuda(lambda: F.dequantize_blockwise(q, st, out=out),
                                 KERNEL_TARGET_S, KERNEL_MAX_REPS)
    # sanity: round-trip error relative to each block's absmax
    err = ((out - a).abs().view(-1, QUANT_BLOCK).amax(1) / a.abs().view(-1, QUANT_BLOCK).amax(1)).max().item()
    add_row("bnb dequantize_blockwise", "one-2^28", n, ms, ms_min, reps, BPE_QUANT,
            f"u8 -> fp32, block 4096, max err/absmax {err:.2e}")


def run_flash():
    name = "flashoptim FlashAdamW"
    try:
        import flashoptim
        from flashoptim import FlashAdamW
        import triton
        log(f"flashoptim {getattr(flashoptim, '__version__', '?')} from {os.path.dirname(flashoptim.__file__)}"
            f" (triton {triton.__version__})")
    except Exception as e:  # noqa: BLE001
        for layout in LAYOUTS:
            not_run(name, layout, f"import flashoptim failed: {type(e).__name__}: {e}")
        return
    # FlashOptim's default (recommended) configuration, stated explicitly:
    # quantize=True (int8 m and v, group 32, fp16 scales), master_weight_bits=24
    # (bf16 params + int8 error-correction bits = 24-bit master weights), fused=True
    # (one Triton kernel per tensor), check_numerics=False; lr 1e-3, wd 1e-2 (decoupled).
    cfg = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
               quantize=True, master_weight_bits=24, fused=True, check_numerics=False)
    log("flashoptim.FlashAdamW, bf16 params + bf16 grads, config: "
        + ", ".join(f"{k}={v}" for k, v in cfg.items()))

    def note_fn(opt, params):
        # public API only: the README documents the correction as optimizer.state[p]["error_bits"]
        err = opt.state[params[0]].get("error_bits")
        return "error_bits " + (str(err.dtype).replace("torch.", "") if err is not None else "none")

    for layout in LAYOUTS:
        opt_case(name, layout, torch.bfloat16, lambda ps: FlashAdamW(ps, **cfg), BPE_FLASH, note_fn)


def run_torchao():
    """torchao's low-bit AdamW (torchao.optim: Python tensor subclasses, each parameter's step one
    torch.compile'd function) on bf16 params and grads, no master weights: AdamW8bit (blocks of 256)
    and AdamW4bit (blocks of 128) with bf16_stochastic_round=True (bnb8's 8bit-sr and 4bit-sr), and
    AdamW4bit as it comes (rounded to nearest). A compile failure is the step's exception: the case
    prints "not run" with it and the script goes on."""
    names = ("torchao AdamW8bit SR", "torchao AdamW4bit SR", "torchao AdamW4bit")
    # The optimizers are Python and torch.compile; the wheel's C++ extensions (other kernels, built
    # against PyPI's CUDA) are not needed, so torchao is told not to load them.
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        import torchao
        from torchao.optim import AdamW4bit, AdamW8bit
        log(f"torchao {getattr(torchao, '__version__', '?')} from {os.path.dirname(torchao.__file__)}")
    except Exception as e:  # noqa: BLE001
        for name in names:
            for layout in LAYOUTS:
                not_run(name, layout, f"import torchao failed: {type(e).__name__}: {e}")
        return
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    cases = (
        (names[0], AdamW8bit, dict(bf16_stochastic_round=True), BPE_AO_8BIT),
        (names[1], AdamW4bit, dict(bf16_stochastic_round=True), BPE_AO_4BIT),
        (names[2], AdamW4bit, {}, BPE_AO_4BIT),
    )
    for name, cls, extra, bpe in cases:
        cfg = dict(hp, **extra)
        log(f"torchao.optim.{cls.__name__}, bf16 params + bf16 grads, default block size, config: "
            + ", ".join(f"{k}={v}" for k, v in cfg.items()))
        for layout in LAYOUTS:
            opt_case(name, layout, torch.bfloat16, lambda ps, cls=cls, cfg=cfg: cls(ps, **cfg), bpe)


PEER_GROUPS = {"torch": run_torch_fused, "bnb": run_bnb, "flash": run_flash, "torchao": run_torchao}


# ----------------------------------------------------------------------------- main

def fmt(v, f):
    return format("-", ">" + f.split(".")[0]) if v is None else format(v, f)


def main():
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to benchmark")
        return 1
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 0)
    gpu = torch.cuda.get_device_name(0)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    log(f"bench_peers: {date}; GPU {gpu}, {props.multi_processor_count} SMs, L2 {l2 / 1e6:.0f} MB, "
        f"{props.total_memory / 2**30:.0f} GiB; torch {torch.__version__} (CUDA {torch.version.cuda}); "
        f"python {sys.version.split()[0]}; seed {seed}")
    log(f"method: CUDA events, warm-up {WARMUP}, median of >= {MIN_REPS} reps, random data, "
        f"buffers >= 1 GiB; ms per 1e9 params = ms * 1e9 / n")

    log("copy bandwidth (device-to-device, 2 GiB buffer)")
    c0 = bench_copy("start")
    free()

    # PEERS="torchao flash" runs those groups only (names as in PEER_GROUPS); the copy runs always
    wanted = os.environ.get("PEERS", "").replace(",", " ").split() or list(PEER_GROUPS)
    for group in wanted:
        if group not in PEER_GROUPS:
            log(f"PEERS: unknown group '{group}' (known: {', '.join(PEER_GROUPS)})")
    for fn in (fn for group, fn in PEER_GROUPS.items() if group in wanted):
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (should not happen: each case has its own try)
            log(f"peer {fn.__name__}: not run ({type(e).__name__}: {e})")
        free()
        log(f"  [{fn.__name__} took {time.time() - t0:.1f} s]")

    log("copy bandwidth again (end of run)")
    c1 = bench_copy("end")
    free()
    copy_gbps = max(c0, c1)
    log(f"copy bandwidth used for %: {copy_gbps:.0f} GB/s (the higher of start {c0:.0f} and end {c1:.0f})")

    for r in ROWS:
        if r["gbps"] is not None:
            r["pct_copy"] = 100.0 * r["gbps"] / copy_gbps

    log("")
    hdr = f"{'name':<26} | {'layout':<11} | {'ms per 1e9 params':>17} | {'B/elem':>6} | {'GB/s':>6} | {'% of copy':>9} | note"
    log(hdr)
    log("-" * len(hdr))
    for r in ROWS:
        log(f"{r['name']:<26} | {r['layout']:<11} | {fmt(r['ms_per_1e9'], '17.2f')} | "
            f"{fmt(r['bytes_per_elem'] or None, '6.2f')} | {fmt(r['gbps'], '6.0f')} | "
            f"{fmt(r['pct_copy'], '8.1f') + ('%' if r['pct_copy'] is not None else ' ')} | {r['note']}")
    log(f"{'copy (d2d, 2 GiB)':<26} | {'-':<11} | {'-':>17} | {8.0:6.2f} | {copy_gbps:6.0f} | {100.0:8.1f}% | read + write")

    out = os.environ.get("OUT")
    if out:
        path = os.path.join(out, "peers.csv")
        fields = ["name", "layout", "n", "reps", "ms_median", "ms_min", "ms_per_1e9", "bytes_per_elem",
                  "gbps", "pct_copy", "copy_gbps", "gpu", "torch", "date", "note"]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            for r in ROWS:
                row = {k: ("" if r.get(k) is None else r.get(k)) for k in fields}
                for k in ("ms_median", "ms_min", "ms_per_1e9", "gbps", "pct_copy"):
                    if r.get(k) is not None:
                        row[k] = f"{r[k]:.4f}"
                row.update(copy_gbps=f"{copy_gbps:.1f}", gpu=gpu, torch=torch.__version__, date=date)
                w.writerow(row)
        log(f"wrote {path}")
    log(f"total time {time.time() - T_START:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
