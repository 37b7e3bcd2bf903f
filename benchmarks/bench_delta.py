"""Delta refits after real optimizer steps: the changed fraction per step, and a delta cycle's
bytes and time against a full cycle of the same version, over NIXL, trainer in its own process.

Trainers (``--trainer``):

* ``megatron`` (CPU): the demo model (``megarefit demo``'s default config, or ``--config``) as
  a real Megatron-Core ``GPTModel`` in bf16, wrapped in Megatron's DDP, stepped by Megatron's
  ``DistributedOptimizer`` (fp32 main params, Adam betas 0.9 / 0.999, no weight decay) on real
  gradients: forward and backward of the next-token loss on random token batches. It serves
  itself with ``Publisher.from_megatron(..., delta=True)``; each step runs inside
  ``Publisher.updating``, so its delta is recorded in the step's seqlock.
* ``adam`` (any device, e.g. a GPU): shards of ``--config`` at ``--tp``, one trainer process per
  rank, fp32 main params stepped by ``torch.optim.Adam`` on random gradients, then copied into
  the bf16 parameters as Megatron's optimizer does; for devices where Megatron-Core is not
  installed.

This process is the receiver side, on ``--device``; per version it runs three staged receivers
of the same trainer: ``full`` (``delta=False``), ``model`` (the cost model on its measured rates)
and ``all-delta`` (every tensor patched: its rates fixed so no tensor is read whole), and checks
that each holds the full receiver's bytes, bit for bit. Per step: changed fraction, bytes each
moved (``stats.bytes_moved``), seconds per cycle (wall, the whole ``run_refit_cycle``), tensors
patched / read whole, and on the trainer the step's seconds and the delta record's seconds.

    python benchmarks/bench_delta.py --trainer megatron --lr 1e-6 1e-5 --steps 10 --json docs/delta_cpu.jsonl
    python benchmarks/bench_delta.py --trainer adam --config tests/data/configs/Qwen3-8B.json --layers 4 --tp 2 \\
        --trainer-device cuda:0 --device cuda:1 --lr 1e-6 1e-5 --steps 8 --json out.jsonl
    python benchmarks/bench_delta.py --from-json docs/delta_cpu.jsonl [--summary]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECEIVERS = ("full", "model", "all-delta")


def _megatron_trainer(port: int, rdzv, cfg: dict, args: dict):
    """The Megatron-Core trainer: (publisher, step function running one training step)."""
    from megarefit.demo.megatron_cpu import bf16_adam_trainer, init_parallel, optimizer_on_cpu
    from megarefit.online.delta.track import track_changes
    from megarefit.online.trainer.publisher import Publisher

    init_parallel(rank=0, world_size=1, master_port=port, tp=1, pp=1)
    model, ddp, opt = bf16_adam_trainer(cfg, lr=args["lr"])
    tracker = track_changes(opt) if args["changes"] == "tracker" else None  # else a host mirror
    pub = Publisher.from_megatron(ddp, cfg, rendezvous=rdzv, agent_name="delta-trainer", delta=True, tracker=tracker)
    g = torch.Generator().manual_seed(0)
    seq, batch = args["seq"], args["batch"]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    position = torch.arange(seq)[None].expand(batch, seq)

    def step(version: int) -> float:
        tokens = torch.randint(0, cfg["vocab_size"], (batch, seq + 1), generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(tokens[:, :-1], position, attention_mask=mask, labels=tokens[:, 1:]).float().mean().backward()
        ddp.finish_grad_sync()
        with pub.updating(version), optimizer_on_cpu():
            t0 = time.perf_counter()
            opt.step()  # with a tracker: its compare inside the main-to-model copy
            return time.perf_counter() - t0

    return pub, step


def _adam_trainer(index: int, rdzv, cfg: dict, args: dict):
    """The torch Adam trainer: rank ``index``'s shards at ``tp``; (publisher, step function)."""
    from megarefit.layout.dims import ModelDims
    from megarefit.layout.geometry import source_tensors
    from megarefit.layout.megatron_model import source_layout
    from megarefit.online.delta.log import DeltaOptions
    from megarefit.online.delta.track import ChangeTracker
    from megarefit.online.trainer.publisher import Publisher

    device = args["trainer_device"]
    dims = ModelDims.from_hf_config(cfg)
    layout = source_layout(cfg, tp=args["tp"], pp=1)
    rank = layout.ranks()[index]
    g = torch.Generator(device=device).manual_seed(index)
    params = {n: (torch.randn(t.shape, generator=g, device=device) * 0.02).to(torch.bfloat16)
              for n, t in source_tensors(dims, layout)[rank].items()}
    main = [p.float() for p in params.values()]
    if args["off_grid"]:  # as after a long run: each fp32 main parameter anywhere within its bf16 value's step
        for m in main:
            ulp = torch.exp2(torch.floor(torch.log2(m.abs().clamp_min(1e-30))) - 7)
            m.add_((torch.rand(m.shape, generator=g, device=device) - 0.5) * ulp)
    opt = torch.optim.Adam(main, lr=args["lr"], betas=(0.9, 0.999), foreach=True)
    model = list(params.values())
    tracker = None
    if args["changes"] == "tracker":  # the main -> model copy marks what it changes: no mirror
        tracker = ChangeTracker()
        tracker.watch(model)
    pub = Publisher(params, cfg, rank=rank, layout=layout, rendezvous=rdzv, agent_name=f"delta-trainer-{index}",
                    delta=DeltaOptions(slots=args["slots"], mirror=args["mirror"]),
                    quantization=args["quantization"], tracker=tracker)

    def step(version: int) -> float:
        for m in main:
            m.grad = torch.randn(m.shape, generator=g, device=device) * 1e-3
        opt.step()
        before = {n: (w.clone(), sc.clone()) for n, (w, sc) in pub.fp8.items()}
        with pub.updating(version):
            _sync(device)
            t0 = time.perf_counter()
            if tracker is None:
                torch._foreach_copy_(model, main)  # Megatron's main -> model copy (a cast to bf16)
            else:
                for p, m in zip(model, main):
                    tracker.copy_(p, m)
            _sync(device)
            copy_s = time.perf_counter() - t0
        pub.fp8_split = fp8_split(before, pub.fp8, pub.quantization.block) if pub.fp8 else None
        return copy_s

    return pub, step


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def fp8_split(before: dict, after: dict, block: tuple[int, int]) -> dict[str, int]:
    """Of the FP8 weight elements that changed in a step: how many lie in blocks whose scale
    changed (the whole block re-scaled) and how many crossed an e4m3 step under an unchanged
    scale; also the blocks, and the blocks whose scale changed."""
    out = {"in_rescaled_blocks": 0, "crossed_a_step": 0, "blocks": 0, "rescaled_blocks": 0, "elements": 0}
    for name, (w, sc) in after.items():
        w0, sc0 = before[name]
        changed = w.view(torch.uint8) != w0.view(torch.uint8)
        rescaled = sc != sc0
        per_element = rescaled.repeat_interleave(block[0], -2)[..., :w.shape[-2], :].repeat_interleave(
            block[1], -1)[..., :w.shape[-1]]
        out["in_rescaled_blocks"] += int((changed & per_element).sum())
        out["crossed_a_step"] += int((changed & ~per_element).sum())
        out["blocks"] += sc.numel()
        out["rescaled_blocks"] += int(rescaled.sum())
        out["elements"] += w.numel()
    return out


def trainer(index: int, _world: int, port: int, rdzv_port: int, cfg: dict, args: dict) -> list[dict]:
    """The trainer process: publish version 1, then one step per version, each after every
    receiver acknowledged the previous; per step its seconds and the delta it recorded."""
    from megarefit.online.store.rendezvous import Rendezvous

    torch.set_num_threads(args["threads"])
    rdzv = Rendezvous.connect("127.0.0.1", rdzv_port, job=args["job"])
    pub, step = _megatron_trainer(port, rdzv, cfg, args) if args["trainer"] == "megatron" else _adam_trainer(
        index, rdzv, cfg, args)
    pub.publish(1)
    rows = []
    for v in range(2, args["steps"] + 2):
        pub.wait_receivers(v - 1, timeout=600)
        t0 = time.perf_counter()
        copy_s = step(v)
        d = pub.last_delta
        rdzv.store.add(f"{rdzv.prefix}bench/stepped/{v}", 1)  # the receivers time from here on
        rows.append({"version": v, "step_s": time.perf_counter() - t0, "record_s": d.seconds, "changed": d.changed,
                     "elements": d.elements, "packed_bytes": d.packed_bytes, "recorded": d.recorded,
                     "host_bytes": pub.delta.nbytes, "fp8": getattr(pub, "fp8_split", None), "copy_s": copy_s})
    pub.wait_receivers(args["steps"] + 1, timeout=600)
    return rows


def _receivers(rdzv, device: str) -> dict:
    from megarefit.online import RefitReceiver

    out = {name: RefitReceiver(rdzv, name=f"delta-{name}", device=device, timeout=600, delta=name != "full")
           for name in RECEIVERS}
    out["all-delta"].delta_model.rates.update(delta_wire=1e30, scatter=1e30, tensor=0.0,  # patch every tensor
                                              full=1e30)
    out["all-delta"].delta_model.learn = False
    return out


def _cycle(rx, version: int, device: str) -> tuple[float, dict[str, torch.Tensor]]:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    got = dict(rx.run_refit_cycle(version))
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, got


def receive(rxs: dict, ns: argparse.Namespace) -> list[dict]:
    """Every version through the three receivers; a row per version and receiver."""
    rows = []
    rdzv = rxs["full"].rendezvous
    for v in range(1, ns.steps + 2):
        while v > 1 and rdzv.store.add(f"{rdzv.prefix}bench/stepped/{v}", 0) < ns.ranks:  # every rank stepped:
            time.sleep(0.001)  # the cycles below time pulls, not the step
        want: dict[str, torch.Tensor] = {}
        for name, rx in rxs.items():
            seconds, got = _cycle(rx, v, ns.device)
            if name == "full":
                want = {k: t.clone() for k, t in got.items()}
            same = got.keys() == want.keys() and all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8))
                                                     for k in want)
            s = rx.stats
            rows.append({"version": v, "receiver": name, "cycle_s": seconds, "bytes_moved": s.bytes_moved,
                         "refit": s.refit, "delta_tensors": s.delta_tensors, "full_tensors": s.full_tensors,
                         "changed_elements": s.changed_elements, "reason": s.delta_reason, "identical": same,
                         "rates": dict(rx.delta_model.rates), "seconds": dict(s.seconds)})
            rx.acknowledge(v)
    for rx in rxs.values():
        rx.close()
    return rows


def summary(rows: list[dict], first: int = 3) -> list[dict]:
    """Per (label, lr) from step ``first`` on: changed fraction, each receiver's bytes as a
    fraction of the full cycle's and its cycle seconds (median, min-max), all identical."""
    out = []
    for key in sorted({(r["label"], r["lr"]) for r in rows}, key=str):
        mine = [r for r in rows if (r["label"], r["lr"]) == key and r["version"] >= first + 1]
        full = {r["version"]: r for r in mine if r["receiver"] == "full"}
        row = {"label": key[0], "lr": key[1], "full_bytes": max(r["bytes_moved"] for r in full.values()), "steps": f"{first}-{max(full) - 1}",
               "changed": [r["changed"] / r["elements"] for r in mine if r["receiver"] == "full"],
               "full_s": [r["cycle_s"] for r in full.values()], "identical": all(r["identical"] for r in mine)}
        for name in RECEIVERS[1:]:
            them = [r for r in mine if r["receiver"] == name]
            row[f"{name}_bytes"] = [r["bytes_moved"] / full[r["version"]]["bytes_moved"] for r in them]
            row[f"{name}_s"] = [r["cycle_s"] for r in them]
            row[f"{name}_refit"] = sorted({r["refit"] for r in them})
        row["step_s"] = [r["step_s"] for r in mine if r["receiver"] == "full"]
        row["record_s"] = [r["record_s"] for r in mine if r["receiver"] == "full"]
        row["copy_s"] = [r.get("copy_s", float("nan")) for r in mine if r["receiver"] == "full"]
        row["delta_bytes"] = max(r["host_bytes"] for r in mine if r["receiver"] == "full")
        out.append(row)
    return out


def _m(xs: list[float], fmt: str = "{:.1%}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def table(rows: list[dict]) -> str:
    head = ("| trainer | full cycle bytes | lr | steps | changed | delta bytes / full (cost model) | all-delta bytes / full | full cycle "
            "| cost-model cycle | all-delta cycle | trainer step | optimizer step / copy | delta record (in the step) "
            "| trainer delta memory | bit-identical |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    runs = sorted({(r["label"], r["machine"], r["date"]) for r in rows})
    lines = [f"Recorded {date} on {machine} ({label})." for label, machine, date in runs] + ["", head]
    ms = "{:.1f} ms"
    for s in summary(rows):
        to_ms = {k: [x * 1e3 for x in s[k]] for k in ("full_s", "model_s", "all-delta_s", "step_s", "record_s",
                                                       "copy_s")}
        copy = "—" if any(math.isnan(x) for x in to_ms["copy_s"]) else _m(to_ms["copy_s"], ms)
        lines.append(f"| {s['label']} | {s['full_bytes'] / 2**20:.1f} MiB | {s['lr']:g} | {s['steps']} | {_m(s['changed'])} | {_m(s['model_bytes'])} "
                     f"| {_m(s['all-delta_bytes'])} | {_m(to_ms['full_s'], ms)} | {_m(to_ms['model_s'], ms)} "
                     f"| {_m(to_ms['all-delta_s'], ms)} | {_m(to_ms['step_s'], ms)} | {copy} "
                     f"| {_m(to_ms['record_s'], ms)} | {s['delta_bytes'] / 2**20:.1f} MiB "
                     f"| {'yes' if s['identical'] else 'NO'} |")
    return "\n".join(lines + fp8_table(rows))


def fp8_table(rows: list[dict], first: int = 3) -> list[str]:
    """Where the trainers served block FP8: of the FP8 elements changed per step (from step
    ``first`` on), the share in blocks whose scale changed, and the share of blocks re-scaled."""
    split = [r for r in rows if r.get("fp8") and r["receiver"] == "full" and r["version"] >= first + 1]
    if not split:
        return []
    out = ["", "| run | lr | FP8 elements changed | of them in re-scaled blocks | blocks re-scaled |", "|---|---|---|---|---|"]
    for key in sorted({(r["label"], r["lr"]) for r in split}, key=str):
        mine = [r["fp8"] for r in split if (r["label"], r["lr"]) == key]
        changed = [(f["in_rescaled_blocks"] + f["crossed_a_step"]) / f["elements"] for f in mine]
        rescaled = [f["in_rescaled_blocks"] / max(1, f["in_rescaled_blocks"] + f["crossed_a_step"]) for f in mine]
        blocks = [f["rescaled_blocks"] / f["blocks"] for f in mine]
        out.append(f"| {key[0]} | {key[1]:g} | {_m(changed)} | {_m(rescaled)} | {_m(blocks)} |")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trainer", choices=["megatron", "adam"], default="megatron")
    p.add_argument("--config", default=None, help="HF config.json (default: the demo's)")
    p.add_argument("--layers", type=int, default=0, help="shrink the config to this many layers")
    p.add_argument("--tp", type=int, default=1, help="--trainer adam: tensor-parallel size (rank 0 is served)")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch threads in the trainer process")
    p.add_argument("--trainer-device", default="cpu")
    p.add_argument("--slots", choices=["host", "device"], default="host",
                   help="--trainer adam: where the trainer packs its deltas (DeltaOptions.slots)")
    p.add_argument("--off-grid", action="store_true",
                   help="--trainer adam: start each fp32 main parameter at random within its bf16 step, as after "
                        "a long run (a fresh start sits on the bf16 grid: large elements cross it only after many steps)")
    p.add_argument("--quantization", choices=["none", "fp8"], default="none",
                   help="--trainer adam: serve block FP8 (the deltas are of FP8 bytes and scales)")
    p.add_argument("--mirror", choices=["host", "device"], default="host",
                   help="--trainer adam: where the trainer keeps the last version (DeltaOptions.mirror)")
    p.add_argument("--changes", choices=["mirror", "tracker"], default="mirror",
                   help="how the trainer finds what changed: a mirror of the last version, or a tracker of the "
                        "main-to-model copy (megatron: track_changes(optimizer); adam: ChangeTracker.copy_)")
    p.add_argument("--device", default="cpu", help="the receivers' device")
    p.add_argument("--label", default="")
    p.add_argument("--json", help="append the rows here (JSON lines)")
    p.add_argument("--from-json", help="print the table of recorded rows")
    return p


def _per_version(ranks: list[list[dict]]) -> dict[int, dict]:
    """The trainer ranks' rows merged per version: counts summed, seconds the slowest rank's."""
    out: dict[int, dict] = {}
    for rows in ranks:
        for r in rows:
            m = out.setdefault(r["version"], dict(r, changed=0, elements=0, packed_bytes=0, host_bytes=0, fp8=None))
            for k in ("changed", "elements", "packed_bytes", "host_bytes"):
                m[k] += r[k]
            for k in ("step_s", "record_s", "copy_s"):
                m[k] = max(m[k], r[k])
            m["recorded"] = m["recorded"] and r["recorded"]
            if r.get("fp8") and m is not r:
                m["fp8"] = {k: m["fp8"][k] + r["fp8"][k] for k in r["fp8"]} if m.get("fp8") else dict(r["fp8"])
    return out


def main(argv: list[str] | None = None) -> int:
    from megarefit.demo.bench import bench_config, machine
    from megarefit.demo.workers import start_workers
    from megarefit.online.store.rendezvous import Rendezvous, ensure_job_secret

    ns = _parser().parse_args(argv)
    if ns.from_json:
        print(table([json.loads(line) for line in Path(ns.from_json).read_text().splitlines() if line.strip()]))
        return 0
    if ns.config:
        cfg = bench_config(ns.config, ns.layers)
    else:
        from megarefit.demo.offline import default_config

        cfg = default_config()
    ensure_job_secret()  # the trainer process inherits it
    rows = []
    for lr in ns.lr:
        job = f"delta-{lr:g}"
        rdzv = Rendezvous.serve(job=job)
        args = {**{k: getattr(ns, k) for k in ("trainer", "steps", "seq", "batch", "threads", "trainer_device", "tp",
                                               "slots", "mirror", "changes")},
                "quantization": None if ns.quantization == "none" else "fp8", "off_grid": ns.off_grid,
                "lr": lr, "job": job}
        rxs = _receivers(rdzv, ns.device)  # registered first: the trainer waits for each to acknowledge
        ns.ranks = 1 if ns.trainer == "megatron" else ns.tp
        group = start_workers(trainer, world_size=ns.ranks, args=(rdzv.port, cfg, args))
        got = receive(rxs, ns)
        by_version = _per_version(group.join(timeout=600))
        head = {"machine": machine(), "label": ns.label or ns.trainer, "slots": ns.slots, "mirror": ns.mirror,
                "changes": ns.changes,
                "off_grid": ns.off_grid, "lr": lr, "config": cfg.get("_name_or_path", ns.config),
                "layers": cfg["num_hidden_layers"], "trainer_device": ns.trainer_device, "device": ns.device,
                "date": time.strftime("%Y-%m-%d")}
        rows += [{**head, **by_version.get(r["version"], {"step_s": 0.0, "record_s": 0.0, "changed": 0,
                                                            "elements": 1}), **r} for r in got]
    print(table(rows), flush=True)
    if ns.json:
        with open(ns.json, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
