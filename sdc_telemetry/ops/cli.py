"""``sdc-telemetry``: the demo, the responder that drains a paged node, checkpoint verification, and regeneration
of the checked-in dashboards and alert rules."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sdc_telemetry.core.config import DEFAULT_METRICS_PORT

__all__ = ["main"]


def _demo_args(p: argparse.ArgumentParser) -> None:
    from sdc_telemetry.ops.demo import FAULTS

    p.add_argument("--fault", choices=FAULTS, default="weight-bitflip", help="fault to inject (default: %(default)s)")
    p.add_argument("--fault-rank", type=int, default=2, help="rank that misbehaves (default: %(default)s)")
    p.add_argument("--fault-step", type=int, default=20, help="step at which the fault starts (default: %(default)s)")
    p.add_argument("--world", type=int, default=None,
                   help="number of CPU ranks (default: 4; 6 with --layout hsdp, so that each shard has 3 replicas "
                        "and a majority names the corrupted one)")
    p.add_argument("--layout", choices=("ddp", "hsdp"), default="ddp",
                   help="ddp, or hsdp: fully_shard on a (world/2 replicas, 2 shards) mesh (default: %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
    p.add_argument("--replay-every", type=int, default=25, help="replay audit cadence (default: %(default)s)")
    p.add_argument("--on-suspect", choices=("record", "raise"), default="raise",
                   help="raise: every rank stops at the incident's step (default); record: train on")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help="base metrics port, rank r serves on base + r (default: %(default)s; 0 = no endpoint)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="interface for the metrics endpoints")
    p.add_argument("--step-delay", type=float, default=None,
                   help="seconds to sleep per step (default: 0, or 0.25 when Prometheus runs, so it sees the run)")
    p.add_argument("--serve-after", type=float, default=None,
                   help="seconds to keep serving metrics after training (default: 0, or until the page arrives)")
    p.add_argument("--incident-dir", default=None, help="directory for incidents.jsonl (default: a temp dir)")
    p.add_argument("--no-stack", action="store_true", help="do not start Prometheus/Alertmanager even if installed")
    p.add_argument("--page-timeout", type=float, default=90.0, help="seconds to wait for the Alertmanager page")


def _stack_cls() -> Any:
    try:
        from sdc_telemetry.ops.stack import LocalStack
    except ImportError:
        return None
    return LocalStack if LocalStack.available() else None


def demo(args: argparse.Namespace) -> int:
    from sdc_telemetry.ops.alerts import SUSPECT_ALERTS
    from sdc_telemetry.ops.demo import DemoPlan, expected, run_rank
    from sdc_telemetry.testing import spawn_ranks

    if args.world is None:
        args.world = 6 if args.layout == "hsdp" else 4
    if not 0 <= args.fault_rank < args.world:
        print(f"--fault-rank must be in 0..{args.world - 1}", file=sys.stderr)
        return 2
    if args.world < 2:
        print("--world must be at least 2: the checks compare replicas", file=sys.stderr)
        return 2
    if args.layout == "hsdp" and (args.world < 4 or args.world % 2):
        print("--layout hsdp needs an even --world of at least 4 (2 shards, 2 or more replicas)", file=sys.stderr)
        return 2
    if args.layout == "hsdp" and args.fault in ("grad-nan", "comm"):
        print(f"--fault {args.fault} injects through DDP hooks: with --layout hsdp use weight-bitflip, compute or "
              "none", file=sys.stderr)
        return 2
    stack_cls = None if args.no_stack or not args.metrics_port else _stack_cls()
    tmp = tempfile.TemporaryDirectory(prefix="sdc-demo-")
    stop_file = str(Path(tmp.name) / "stop")
    plan = DemoPlan(
        fault=args.fault, fault_rank=args.fault_rank, fault_step=args.fault_step, steps=args.steps,
        replay_every=args.replay_every, on_suspect=args.on_suspect, metrics_port=args.metrics_port or None,
        metrics_host=args.metrics_host,
        step_delay=args.step_delay if args.step_delay is not None else (0.25 if stack_cls else 0.0),
        serve_after=args.serve_after if args.serve_after is not None else (args.page_timeout if stack_cls else 0.0),
        stop_file=stop_file, incident_dir=args.incident_dir or tmp.name, checkpoint_dir=tmp.name, layout=args.layout,
        certify_step=max(0, min(args.fault_step, args.steps) // 2),
        close_scrape_wait_s=8.0 if stack_cls else 0.0,  # nobody scrapes without Prometheus: do not wait for it
    )
    want = expected(plan)
    print(f"sdc-telemetry demo: {args.world} CPU ranks (gloo, {plan.layout}), fault={plan.fault}"
          + (f" on rank {plan.fault_rank} at step {plan.fault_step}" if want else "")
          + f", {plan.steps} steps, replay every {plan.replay_every}, on_suspect={plan.on_suspect}", flush=True)
    if plan.metrics_port:
        ports = ", ".join(f"http://{plan.metrics_host}:{plan.metrics_port + r}/metrics" for r in range(args.world))
        print(f"metrics: {ports}  (GPU counters come from a fake NVML on this CPU-only demo)", flush=True)
    results: list[Any] = []
    failure: list[BaseException] = []

    def train(run_plan: DemoPlan) -> None:
        try:
            results.extend(spawn_ranks(run_rank, args.world, (run_plan,), timeout=600,
                                       rank_env=lambda r: {"LOCAL_RANK": str(r)}))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)

    page, drained = None, None
    try:
        if stack_cls is not None:
            from sdc_telemetry.ops.respond import Responder

            drains = Path(tmp.name) / "drained.jsonl"
            # A harmless stand-in for `scontrol update NodeName={host_name} State=DRAIN ...`: it records its argv.
            recorder = (f"{shlex.quote(sys.executable)} -c {shlex.quote(_RECORDER)} {shlex.quote(str(drains))} "
                        "drain {host_name} rank={rank} gpu={hw_id} alert={alertname}")
            targets = [f"127.0.0.1:{plan.metrics_port + r}" for r in range(args.world)]  # type: ignore[operator]
            with Responder(recorder) as responder, \
                    stack_cls(targets=targets, workdir=tmp.name, responder_url=f"{responder.url}/alerts") as stack:
                print(f"prometheus: {stack.prometheus_url}  alertmanager: {stack.alertmanager_url}  "
                      f"responder: {responder.url}", flush=True)
                run_plan = dataclasses.replace(plan, alertmanager_url=stack.alertmanager_url)
                trainer = threading.Thread(target=train, args=(run_plan,), daemon=True)
                trainer.start()
                if want is not None:
                    page = stack.wait_for_alert(SUSPECT_ALERTS[want[0][0]], timeout=args.page_timeout)
                    drained = _wait_for_line(drains, timeout=30.0)
                Path(stop_file).touch()
                trainer.join()
        else:
            train(plan)
    finally:
        Path(stop_file).touch()
    if failure:
        print(f"demo failed: {failure[0]}", file=sys.stderr)
        tmp.cleanup()
        return 1
    ok = _report(results, want, plan.incident_dir)
    if page is not None:
        labels = page.get("labels", {})
        print(f"page received from Alertmanager: {labels.get('alertname')} [{labels.get('severity')}] "
              f"host={labels.get('host_name')} rank={labels.get('rank')} gpu={labels.get('hw_id')}: "
              f"{page.get('annotations', {}).get('summary', '')}")
    elif stack_cls is not None and want is not None:
        print("no page arrived from Alertmanager in time", file=sys.stderr)
        ok = False
    if drained is not None:
        print(f"responder drained the node (recorder in place of scontrol): {' '.join(drained)}")
    elif stack_cls is not None and want is not None:
        print("the responder did not act on the page in time", file=sys.stderr)
        ok = False
    ok = _check_checkpoint(results, want) and ok
    tmp.cleanup()
    return 0 if ok else 1


# Appends its arguments (after the file name) as one JSON line to the file named by its first argument.
_RECORDER = "import json, sys; open(sys.argv[1], 'a').write(json.dumps(sys.argv[2:]) + chr(10))"


def _wait_for_line(path: Path, timeout: float) -> list[str] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            first: list[str] = json.loads(path.read_text().splitlines()[0])
            return first
        time.sleep(0.1)
    return None


def _check_checkpoint(results: list[dict[str, Any]], want: tuple[tuple[str, ...], int, int] | None) -> bool:
    """Verify the demo's checkpoint against its certificate, and say whether it predates the incident."""
    import torch

    from sdc_telemetry.core.certificate import WeightCertificate

    path = results[0].get("checkpoint") if results else None
    if not path or not Path(path).exists():
        print("no certified checkpoint was saved (the run stopped before the certification step)")
        return want is None or want[1] <= results[0]["plan"]["certify_step"]
    ckpt = torch.load(path, weights_only=True)
    cert = WeightCertificate.from_dict(ckpt["sdc_certificate"])
    bad = cert.verify(ckpt["model"])
    before = want is None or cert.step < want[1]
    print(f"checkpoint of step {cert.step}: {'intact' if not bad else 'DIFFERS in ' + ', '.join(bad)} "
          f"({len(cert.fingerprints)} tensors verified)"
          + (f"; certified before the incident at step {want[1]}: resume from it" if want and before else ""))
    return not bad and before


def _verdicts(result: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(i["step"], i["check"], tuple(i["suspect_ranks"])) for i in result["incidents"]]


def _report(results: list[dict[str, Any]], want: tuple[tuple[str, ...], int, int] | None,
            incident_dir: str | None) -> bool:
    incidents = results[0]["incidents"]
    same = all(_verdicts(r) == _verdicts(results[0]) for r in results)
    print(f"\n{len(incidents)} incident(s); every rank recorded the same verdicts: {same}")
    for inc in incidents:
        for s in inc["suspects"]:
            print(f"  step {inc['step']}: check {inc['check']} suspects host {s['host_name']} rank {s['rank']} "
                  f"GPU {s['hw_id']}" + (" (ambiguous)" if inc["evidence"].get("ambiguous") else ""))
    if incident_dir:
        path = Path(incident_dir) / "incidents.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        print(f"incident file: {len(lines)} JSON line(s)")
    if want is None:
        ok = same and not incidents
        print("outcome: healthy run, no incident" if ok else "outcome: UNEXPECTED incidents on a healthy run")
        return ok
    checks, step, rank = want
    first = incidents[0] if incidents else None
    ok = same and first is not None and first["check"] in checks and first["step"] == step \
        and first["suspect_ranks"] == [rank]
    print(f"outcome: {'as predicted' if ok else 'NOT as predicted'} (expected check {' or '.join(checks)} at step "
          f"{step} naming rank {rank})")
    return ok


def regenerate(kind: str, out: str | None) -> int:
    root = Path(__file__).resolve().parents[2]
    if kind == "dashboards":
        from sdc_telemetry.ops.dashboards import generate
    else:
        from sdc_telemetry.ops.alerts import generate
    paths = generate(Path(out) if out else root / kind)
    for p in paths:
        print(p)
    return 0


def _respond_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="where Alertmanager's webhook posts (POST /alerts or /; GET /healthz)")
    p.add_argument("--command", required=True, metavar="TEMPLATE", dest="template",
                   help="command run once per paged host, split like a shell line, run without a shell; "
                        "placeholders {host_name} {rank} {hw_id} {alertname}")
    p.add_argument("--max-actions-per-hour", type=int, default=3,
                   help="refuse (and log) further actions past this many in any hour (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="log the command instead of running it")
    p.add_argument("--state", default=None, metavar="FILE",
                   help="JSON file remembering the hosts acted on across restarts (default: memory only)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per command run (default: %(default)s)")


def respond(args: argparse.Namespace) -> int:
    import logging
    import signal

    from sdc_telemetry.ops.respond import Responder, TemplateError, parse_listen

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        host, port = parse_listen(args.listen)
        responder = Responder(args.template, host=host, port=port, max_actions_per_hour=args.max_actions_per_hour,
                              dry_run=args.dry_run, state_file=args.state, timeout_s=args.timeout)
    except TemplateError as e:
        print(f"sdc-telemetry respond: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"sdc-telemetry respond: {str(e).replace('max_actions_per_hour', '--max-actions-per-hour')}",
              file=sys.stderr)
        return 2
    except OSError as e:
        print(f"sdc-telemetry respond: cannot listen on {args.listen}: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"sdc-telemetry respond: listening on {responder.url} (POST /alerts, GET /healthz)", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        responder.close()
    return 0


def verify_checkpoint(path: str, key: str | None) -> int:
    import torch

    from sdc_telemetry.core.certificate import WeightCertificate

    def fail(msg: str) -> int:
        print(f"sdc-telemetry verify-checkpoint: {path}: {msg}", file=sys.stderr)
        return 2

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is reported the same way
        return fail(f"cannot load with torch.load(weights_only=True): {type(e).__name__}: {e}")
    if not isinstance(ckpt, dict):
        return fail(f"the checkpoint is a {type(ckpt).__name__}, not a dict holding 'sdc_certificate'")
    if "sdc_certificate" not in ckpt:
        return fail("no 'sdc_certificate' entry: save cert.to_dict() from monitor.certificate() with the model")
    try:
        cert = WeightCertificate.from_dict(ckpt["sdc_certificate"])
    except ValueError as e:
        return fail(f"malformed certificate: {e}")
    if key is not None and key not in ckpt:
        return fail(f"no entry {key!r} (entries: {', '.join(map(str, ckpt))})")
    name = key if key is not None else ("model" if "model" in ckpt else None)
    state = ckpt[name] if name is not None else {k: v for k, v in ckpt.items() if k != "sdc_certificate"}
    if not isinstance(state, dict):
        return fail(f"entry {name!r} is a {type(state).__name__}, not a state dict")
    try:
        bad = cert.verify(state)
    except ValueError as e:
        return fail(str(e))
    n = len(cert.fingerprints)
    if not bad:
        print(f"intact: {n} tensors verified (step {cert.step})")
        return 0
    print(f"CORRUPT: {len(bad)} of {n} tensors differ from the certificate of step {cert.step} "
          f"(changed, missing, or of another shape or dtype):")
    for b in bad:
        print(f"  {b}")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sdc-telemetry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_args(sub.add_parser("demo", help="multi-rank CPU training with an injected fault, the suspect named"))
    for kind in ("dashboards", "alerts"):
        p = sub.add_parser(kind, help=f"regenerate the checked-in {kind}")
        p.add_argument("--out", default=None, help=f"output directory (default: the repository's {kind}/)")
    _respond_args(sub.add_parser("respond", help="Alertmanager webhook receiver that drains the paged node"))
    p = sub.add_parser("verify-checkpoint", help="check a checkpoint's weights against its SDC weight certificate")
    p.add_argument("path", help="a torch.save'd dict holding 'sdc_certificate' and the model state dict")
    p.add_argument("--key", default=None,
                   help="entry holding the state dict (default: 'model', else the top-level dict itself)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    if args.command == "respond":
        return respond(args)
    if args.command == "verify-checkpoint":
        return verify_checkpoint(args.path, args.key)
    return regenerate(args.command, args.out)


if __name__ == "__main__":
    sys.exit(main())


