"""Where the monitor's host time goes on the Llama step (one device call)."""
import cProfile, pstats, io, sys, time, threading, tempfile, os
import torch
sys.path.insert(0, "benchmarks")
import bench_steps as bs
import stabilitywatch as sw

dev = "cuda"
def per_step(model, cfg, steps=45, prof=None, tag=""):
    m, fwd, opt, ids = bs.build(model, dev, False)
    out = tempfile.mkdtemp()
    mon = sw.watch(m, opt, config=cfg, run_dir=out) if cfg is not None else None
    times = []
    tt = []
    for i in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); c0 = time.thread_time()
        if prof is not None and i >= 15: prof.enable()
        bs.step(fwd, opt, ids, mon, i, dev)
        if prof is not None and i >= 15: prof.disable()
        c1 = time.thread_time()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3); tt.append((c1 - c0) * 1e3)
    ptime = None
    if mon:
        for th in threading.enumerate():
            pass
        mon.close()
    samp = [i for i in range(15, steps) if i % 10 == 0]
    uns = [i for i in range(15, steps) if i % 10 != 0]
    med = lambda xs: sorted(xs)[len(xs) // 2]
    r = dict(samp_wall=med([times[i] for i in samp]), uns_wall=med([times[i] for i in uns]),
             samp_cpu=med([tt[i] for i in samp]), uns_cpu=med([tt[i] for i in uns]))
    print(f"# {model} {tag}: sampled wall {r['samp_wall']:.2f} cpu {r['samp_cpu']:.2f} | "
          f"unsampled wall {r['uns_wall']:.2f} cpu {r['uns_cpu']:.2f}", flush=True)
    del m, fwd, opt, mon
    return r

def show(prof, title, n=45):
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s); st.sort_stats("tottime").print_stats(n)
    print(f"\n######## {title} (tottime)\n" + s.getvalue()[-9000:])
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s); st.sort_stats("cumulative").print_stats("stabilitywatch", 45)
    print(f"\n######## {title} (cumulative, stabilitywatch)\n" + s.getvalue()[-9000:])

res = {}
which = sys.argv[1] if len(sys.argv) > 1 else "all"
if which in ("all", "time"):
    for rnd in range(2):
        for tag, cfg in [("none", None), ("default", sw.Config()), ("default,inline", sw.Config(processing="inline")),
                         ("every=1", sw.Config(every=1)), ("default,nosentinel", sw.Config(sentinel=False))]:
            res.setdefault(tag, []).append(per_step("llama", cfg, tag=f"r{rnd} {tag}"))
if which in ("all", "prof"):
    for tag, cfg in [("default inline", sw.Config(processing="inline")), ("every=1 inline", sw.Config(every=1, processing="inline"))]:
        p = cProfile.Profile()
        per_step("llama", cfg, steps=45, prof=p, tag="profiled " + tag)
        show(p, tag)
if which in ("all", "fp8"):
    import torch._dynamo as dyn
    for tag, cfg in [("none", None), ("default", sw.Config())]:
        dyn.reset(); dyn.utils.counters.clear()
        per_step("llama-fp8", cfg, tag="fp8 " + tag)
        print("# fp8", tag, "graph breaks:", dict(dyn.utils.counters["graph_break"]) if dyn.utils.counters["graph_break"] else 0,
              "frames:", dict(dyn.utils.counters["frames"]), "recompiles:", dict(dyn.utils.counters.get("recompiles", {})), flush=True)
print("\n| config | sampled wall | sampled cpu | unsampled wall | unsampled cpu |")
for tag, rs in res.items():
    for r in rs:
        print(f"| {tag} | {r['samp_wall']:.2f} | {r['samp_cpu']:.2f} | {r['uns_wall']:.2f} | {r['uns_cpu']:.2f} |")
