"""scale_accuracy_peers.py: how close each 8-bit optimizer ends to fp32 AdamW, on the GPU, every optimizer
on the same tensors (the flash group scales' accuracy run; its CPU twin is dev/bench/scale_accuracy.c).

n = 2^22; p0 = 0.02 randn rounded to bf16; per element a fixed scale s = 1e-3 exp(0.5 randn); the
gradient of step t is (randn + 0.3) s rounded to bf16; AdamW lr 1e-3, betas (0.9, 0.999), eps 1e-8,
weight decay 1e-2, 200 steps. Distance = |master - w_fp32| / |w_fp32 - p0| (L2, float64), w_fp32 from
torch.optim.AdamW in fp32 on the same gradients. Each step draws one gradient on the GPU and every
optimizer reads that same tensor: torch's fp32 AdamW (the reference), FlashOptim's FlashAdamW (fp16
group scales, int8 ECC; and with fp32 states), and bnb8 (through build/libbnb8_shim.so, ctypes) with
each group scale type and master kind.

On the GPU machine:  make build/libbnb8_shim.so && PYTHONPATH=.whl/site python3 dev/bench/peers/scale_accuracy_peers.py
(flashoptim from .whl/site as dev/bench/peers/README.md says; without it the FlashOptim rows say why).
SCALE_N and SCALE_STEPS shrink the run for a quick look.
"""
import ctypes
import os
import sys

import torch

N = int(os.environ.get("SCALE_N", 1 << 22))
STEPS = int(os.environ.get("SCALE_STEPS", 200))
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2
DEV = torch.device("cuda")
F32, F16, BF16 = 0, 1, 2                      # bnb8_dtype (3: e6m10, the default scale)
STATE_32BIT, STATE_8BIT, STATE_FLASH = 0, 1, 2

gen = torch.Generator(device=DEV)
gen.manual_seed(1234)
p0 = (0.02 * torch.randn(N, generator=gen, device=DEV)).to(torch.bfloat16)
s = 1e-3 * torch.exp(0.5 * torch.randn(N, generator=gen, device=DEV))
p0_host = p0.float().cpu().contiguous()
gbuf = torch.empty(N, dtype=torch.bfloat16, device=DEV)   # every step's gradient, read by all

runs = {}   # name -> (step(), master() -> float32 tensor on the GPU)

# the reference: PyTorch AdamW, fp32 weights and gradients
w_ref = torch.nn.Parameter(p0.float().clone())
opt_ref = torch.optim.AdamW([w_ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)


def ref_step():
    w_ref.grad = gbuf.float()
    opt_ref.step()


# FlashOptim
try:
    import flashoptim

    def flashoptim_run(quantize):
        w = torch.nn.Parameter(p0.clone())
        o = flashoptim.FlashAdamW([w], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, quantize=quantize)

        def step():
            w.grad = gbuf.clone()
            o.step()

        def master():
            st = o.state[w]
            return flashoptim.reconstruct_fp32_param(w.detach(), st["error_bits"]).float() if "error_bits" in st else w.detach().float()
        return step, master

    runs["FlashOptim FlashAdamW (fp16 scales, int8 ECC)"] = flashoptim_run(True)
    runs["FlashOptim FlashAdamW quantize=False (fp32 states, int8 ECC)"] = flashoptim_run(False)
except Exception as e:  # noqa: BLE001
    print(f"peer FlashOptim: not run ({type(e).__name__}: {e})")

# bnb8
lib = ctypes.CDLL(os.path.join(os.path.dirname(__file__), "..", "..", "..", "build", "libbnb8_shim.so"))
lib.shim_open.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                          ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                          ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p]
lib.shim_step.argtypes = [ctypes.c_void_p, ctypes.c_float]
lib.shim_export.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.shim_free.argtypes = [ctypes.c_void_p]
lib.shim_error.restype = ctypes.c_char_p


gbuf32 = torch.empty(N, dtype=torch.float32, device=DEV)   # the same gradient in fp32, for the control
keep = []   # the tensors bnb8 holds pointers to, alive until the end


def bnb8_run(fmt, corr, scale_dtype, wdt=BF16):
    w = p0.clone() if wdt == BF16 else p0.float()
    g = gbuf if wdt == BF16 else gbuf32
    h = ctypes.c_void_p()
    if lib.shim_open(ctypes.byref(h), fmt, corr, scale_dtype, LR, BETAS[0], BETAS[1], EPS, WD, w.data_ptr(), wdt,
                     g.data_ptr(), wdt, N, p0_host.data_ptr()):
        raise RuntimeError(lib.shim_error().decode())
    keep.append((w, h))

    def step():
        if lib.shim_step(h, LR):
            raise RuntimeError(lib.shim_error().decode())

    def master():
        out = torch.empty(N, dtype=torch.float32)
        if lib.shim_export(h, out.data_ptr()):
            raise RuntimeError(lib.shim_error().decode())
        return out.to(DEV)
    return step, master


for name, args in [("bnb8 32-bit AdamW, fp32 weights (the control: ~0)", (STATE_32BIT, 0, -1, F32)),
                   ("bnb8 flash, the default scale (e6m10, nearest)", (STATE_FLASH, -1, -1)),
                   ("bnb8 flash, bf16 scales", (STATE_FLASH, -1, BF16)),
                   ("bnb8 flash, fp16 scales", (STATE_FLASH, -1, F16)),
                   ("bnb8 flash, fp32 scales", (STATE_FLASH, -1, F32)),
                   ("bnb8 32-bit states, int8 correction", (STATE_32BIT, 1, -1)),
                   ("bnb8 32-bit states, fp32 master", (STATE_32BIT, 4, -1)),
                   ("bnb8 8-bit states (blocks of 256), int8 correction", (STATE_8BIT, 1, -1)),
                   ("bnb8 32-bit states, no correction (bf16 weights)", (STATE_32BIT, 0, -1))]:
    try:
        runs[name] = bnb8_run(*args)
    except Exception as e:  # noqa: BLE001
        print(f"{name}: not run ({e})")

print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, n = {N}, {STEPS} steps", flush=True)
for t in range(STEPS):
    gbuf.copy_(((torch.randn(N, generator=gen, device=DEV) + 0.3) * s).to(torch.bfloat16))
    gbuf32.copy_(gbuf)
    torch.cuda.synchronize()
    ref_step()
    for step, _ in runs.values():
        step()
    torch.cuda.synchronize()

ref = w_ref.detach().double()
moved = torch.linalg.vector_norm(ref - p0.double()).item()
print(f"fp32 AdamW moved the weights by {moved:.4f} (L2)")
print(f"{'run':<58} distance from fp32 AdamW | moved / fp32's | cosine with fp32's move")
for name, (_, master) in runs.items():
    m = master().double()
    d = torch.linalg.vector_norm(m - ref).item() / moved
    mv = torch.linalg.vector_norm(m - p0.double()).item()
    cos = torch.dot(m - p0.double(), ref - p0.double()).item() / max(mv * moved, 1e-300)
    print(f"{name:<58} {d:.5f} | {mv / moved:.4f} | {cos:.5f}")
sys.stdout.flush()
