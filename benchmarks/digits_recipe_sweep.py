"""The recipe sweep behind examples/digits_cnn.py's defaults (kept as it ran: its data split, network and training
loop restate the example's with the sweep's extra knobs, so the recorded results stay reproducible by it): dense recipes (DENSE) x fine-tuning variants (V)
x seeds, GPU jobs in NG processes and CPU jobs (one thread each) in NC processes at once, every result a JSON
line in $OUT/sweep.jsonl (drop_img: dense minus pruned correct test images, of 540). Run from the repo root
with .digits/digits.npz (examples/digits_cnn.py --export-data writes it):

    OUT=/tmp DEADLINE=430 NG=10 NC=4 python benchmarks/digits_recipe_sweep.py

One H200 with 16 cores: 208 results in 200 s (results/digits_cnn_recipe_sweep_2026-12-02.jsonl; its last 18 rows are the 64/128 network on the 2-core CPU host). Variants:
old = the earlier example (dense at a constant lr, masks from 10% to 50% of fine-tuning, no decay); a = from the
trained dense, masks over the first half, cosine after it; b: masks over the first third; c: cosine over the whole
fine-tuning; d / e: lr 2e-3 / 5e-4; f: per-layer ranking; g: label smoothing 0.1; h / i: 30 / 100 epochs;
k: distillation; dense_long: a second dense network trained twice as long (drop_img absent; long_correct).
Each fine-tuning starts from torch.manual_seed(seed + 17), so its figures are not the example's own runs."""
import copy, json, math, os, sys, time
import multiprocessing as mp
import torch
from torch import nn

T0 = time.time()
DEADLINE = float(os.environ.get("DEADLINE", "470"))

def digits(device, path):
    import numpy as np
    data = np.load(path)
    x = torch.tensor(data["images"], dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data["target"])
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    split = int(0.7 * len(y))
    tr, te = order[:split], order[split:]
    return x[tr].to(device), y[tr].to(device), x[te].to(device), y[te].to(device)

def net(c1, c2):
    return nn.Sequential(nn.Conv2d(1, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(),
                         nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.BatchNorm2d(c2), nn.ReLU(),
                         nn.Flatten(), nn.Linear(c2 * 4 * 4, 10))

def train(model, x, y, epochs, lr, sched, ls=0.0, wd=0.0, pruner=None, warm=0, teacher=None, batch=64):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd) if wd else torch.optim.Adam(model.parameters(), lr=lr)
    total = epochs * ((len(y) + batch - 1) // batch)
    def f(t):
        if sched == "const": return 1.0
        if sched == "cos": return 0.5 * (1 + math.cos(math.pi * min(t, total) / total))
        if t < warm: return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(t - warm, total - warm) / max(1, total - warm)))
    s = torch.optim.lr_scheduler.LambdaLR(opt, f)
    for _ in range(epochs):
        model.train()
        order = torch.randperm(len(y), device=y.device)
        for i in range(0, len(y), batch):
            idx = order[i:i + batch]
            logits = model(x[idx])
            loss = nn.functional.cross_entropy(logits, y[idx], label_smoothing=ls)
            if teacher is not None:
                with torch.no_grad():
                    soft = (teacher(x[idx]) / 4.0).log_softmax(1)
                loss = loss + 16.0 * nn.functional.kl_div((logits / 4.0).log_softmax(1), soft, log_target=True,
                                                          reduction="batchmean")
            opt.zero_grad(); loss.backward(); opt.step(); s.step()
            if pruner is not None: pruner.step()

def predict(m, x):
    m.eval()
    with torch.no_grad():
        return m(x).argmax(1)

DENSE = {"old": dict(c=(32, 64), de=60, dlr=2e-3, ds="const"),
         "cos": dict(c=(32, 64), de=60, dlr=2e-3, ds="cos"),
         "wide": dict(c=(64, 128), de=60, dlr=2e-3, ds="cos")}
BASE = dict(pe=60, plr=1e-3, ps="cos_after", begin=0.0, end=0.5, freq=0, scope="global", ls=0.0, wd=0.0, kd=False)
V = {"old": dict(BASE, ps="const", begin=0.1, end=0.5, freq=-1),
     "a": BASE, "b": dict(BASE, end=0.33), "c": dict(BASE, ps="cos"), "d": dict(BASE, plr=2e-3),
     "e": dict(BASE, plr=5e-4), "f": dict(BASE, scope="layer"), "g": dict(BASE, ls=0.1),
     "h": dict(BASE, pe=30), "i": dict(BASE, pe=100), "k": dict(BASE, kd=True)}
PLAN = {"old": ["old", "a"], "cos": ["a", "b", "i", "d", "c", "e", "f", "g", "h", "k", "dense_long"],
        "wide": ["a", "b", "i", "d", "h", "dense_long"]}

def job(args):
    dname, seed, device, variants = args
    sys.path.insert(0, "src")
    from sparseforge.prune import GradualPruner, remove_masks
    if device == "cpu": torch.set_num_threads(1)
    out = []
    D = DENSE[dname]
    torch.manual_seed(seed)
    xt, yt, xs, ys = digits(device, ".digits/digits.npz")
    t = time.time()
    dense = net(*D["c"]).to(device)
    train(dense, xt, yt, D["de"], D["dlr"], D["ds"])
    dp = predict(dense, xs); da = int((dp == ys).sum())
    tdense = time.time() - t
    for v in variants:
        if time.time() - T0 > DEADLINE: break
        t = time.time()
        rec = dict(dense=dname, seed=seed, device=device, variant=v, dense_correct=da, tdense=round(tdense, 1))
        if v == "dense_long":
            torch.manual_seed(seed + 1000)
            m = net(*D["c"]).to(device); train(m, xt, yt, 2 * D["de"], D["dlr"], D["ds"])
            rec["long_correct"] = int((predict(m, xs) == ys).sum())
        else:
            P = V[v]
            torch.manual_seed(seed + 17)
            pm = copy.deepcopy(dense)
            steps = P["pe"] * ((len(yt) + 63) // 64)
            b, e = int(P["begin"] * steps), int(P["end"] * steps)
            if v == "old":
                steps_old = 60 * 20
                b, e, fr = steps_old // 10, steps_old // 2, max(1, steps_old // 100)
            else:
                fr = P["freq"] or max(1, (e - b) // 30)
            pr = GradualPruner(pm, 0.9, begin_step=b, end_step=e, frequency=fr, scope=P["scope"])
            train(pm, xt, yt, P["pe"], P["plr"], P["ps"], P["ls"], P["wd"], pruner=pr, warm=e,
                  teacher=dense.eval() if P["kd"] else None)
            remove_masks(pm)
            pp = predict(pm, xs)
            rec["pruned_correct"] = int((pp == ys).sum()); rec["drop_img"] = da - rec["pruned_correct"]
            rec["disagree_dense"] = int((pp != dp).sum())
        rec["t"] = round(time.time() - t, 1)
        out.append(rec)
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "sweep.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")
    return out

if __name__ == "__main__":
    mp.set_start_method("spawn")
    gpu_jobs, cpu_jobs = [], []
    for seeds in ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9]):
        for d in ("cos", "wide", "old"):
            for s in seeds:
                gpu_jobs.append((d, s, "cuda", PLAN[d]))
    for s in range(6):
        cpu_jobs.append(("cos", s, "cpu", ["a", "b", "i"]))
    ng, nc = int(os.environ.get("NG", "10")), int(os.environ.get("NC", "4"))
    pg, pc = mp.Pool(ng), mp.Pool(nc)
    rg = pg.map_async(job, gpu_jobs, chunksize=1); rc = pc.map_async(job, cpu_jobs, chunksize=1)
    rg.wait(DEADLINE + 60); rc.wait(max(1, DEADLINE + 60 - (time.time() - T0)))
    print("done", time.time() - T0)
    pg.terminate(); pc.terminate()
