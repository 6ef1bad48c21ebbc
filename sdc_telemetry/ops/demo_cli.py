"""``sdc-telemetry demo``: its flags, the run (CPU ranks training with an injected fault, the local
Prometheus/Alertmanager stack when installed, the authenticated responder draining the paged node, the screen after
the drain) and the report of every part. The training and the responder's setup live in
:mod:`sdc_telemetry.ops.demo`."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from sdc_telemetry.core.config import DEFAULT_METRICS_PORT
from sdc_telemetry.ops.fleet_cli import fleet

__all__ = ["add_demo_args", "demo"]


def add_demo_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--replay-every", type=int, default=10,
                   help="replay audit cadence: steps k with k %% N == 0 (default: %(default)s)")
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
    from sdc_telemetry.ops.demo import DemoPlan, certify_plan, expected

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
    # The responder runs in this process: its log lines (the drain, the screen's output) carry a prefix.
    logging.basicConfig(level=logging.WARNING, format="[responder] %(levelname)s %(message)s")
    tmp = tempfile.TemporaryDirectory(prefix="sdc-demo-")
    try:
        plan = DemoPlan(
            fault=args.fault, fault_rank=args.fault_rank, fault_step=args.fault_step, steps=args.steps,
            replay_every=args.replay_every, on_suspect=args.on_suspect, metrics_port=args.metrics_port or None,
            metrics_host=args.metrics_host,
            step_delay=args.step_delay if args.step_delay is not None else (0.25 if stack_cls else 0.0),
            serve_after=args.serve_after if args.serve_after is not None else (args.page_timeout if stack_cls else 0.0),
            stop_file=str(Path(tmp.name) / "stop"), incident_dir=args.incident_dir or tmp.name,
            checkpoint_dir=tmp.name, layout=args.layout,
            close_scrape_wait_s=8.0 if stack_cls else 0.0,  # nobody scrapes without Prometheus: do not wait for it
        )
        want = expected(plan)
        certify, resume_step = certify_plan(want[1] if want else None, plan.replay_every, plan.steps)
        plan = dataclasses.replace(plan, certify_steps=certify)
        return _demo_run(args, plan, want, resume_step, stack_cls, Path(tmp.name))
    finally:
        tmp.cleanup()


def _demo_run(args: argparse.Namespace, plan: Any, want: tuple[tuple[str, ...], int, int] | None,
              resume_step: int | None, stack_cls: Any, workdir: Path) -> int:
    """Train (with the local stack when there is one), respond to the page, and report every part; exit code."""
    from sdc_telemetry.ops.alerts import SUSPECT_ALERTS
    from sdc_telemetry.ops.demo import DemoResponder, run_rank
    from sdc_telemetry.testing import spawn_ranks

    print(f"sdc-telemetry demo: {args.world} CPU ranks (gloo, {plan.layout}), fault={plan.fault}"
          + (f" on rank {plan.fault_rank} at step {plan.fault_step}" if want else "")
          + f", {plan.steps} steps, replay every {plan.replay_every}, on_suspect={plan.on_suspect}", flush=True)
    if plan.metrics_port:
        ports = ", ".join(f"http://{plan.metrics_host}:{plan.metrics_port + r}/metrics" for r in range(args.world))
        print(f"metrics: {ports}  (GPU counters come from a fake NVML on this CPU-only demo)", flush=True)
    results: list[Any] = []
    failure: list[BaseException] = []

    def train(run_plan: Any) -> None:
        try:
            results.extend(spawn_ranks(run_rank, args.world, (run_plan,), timeout=600,
                                       rank_env=lambda r: {"LOCAL_RANK": str(r)}))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            failure.append(e)

    page: dict[str, Any] | None = None
    loop = _DemoLoop()
    stop_file = Path(plan.stop_file)
    try:
        with contextlib.ExitStack() as held:
            response = None
            if want is not None:
                response = held.enter_context(DemoResponder(workdir, drill_device=plan.fault_rank))
                print(f"responder: {response.url}, bearer token in {response.token_file} (the drain command is a "
                      f"recorder standing in for scontrol), ledger {response.ledger_url}", flush=True)
                loop.forged = response.post([_forged_page()], token=None)
            if stack_cls is not None:
                targets = [f"127.0.0.1:{plan.metrics_port + r}" for r in range(args.world)]
                stack = held.enter_context(stack_cls(
                    targets=targets, workdir=workdir, responder_url=response.url if response else None,
                    responder_credentials_file=response.token_file if response else None))
                print(f"prometheus: {stack.prometheus_url}  alertmanager: {stack.alertmanager_url} (routes SDC "
                      "criticals to the responder with the token from its credentials_file)", flush=True)
                trainer = threading.Thread(target=train, args=(dataclasses.replace(
                    plan, alertmanager_url=stack.alertmanager_url),), daemon=True)
                trainer.start()
                if want is not None and response is not None:
                    page = stack.wait_for_alert(SUSPECT_ALERTS[want[0][0]], timeout=args.page_timeout)
                    loop.drained = response.wait_drain(timeout=30.0)
                stop_file.touch()
                trainer.join()
            else:
                train(plan)
                if response is not None and not failure:
                    page = _suspect_page(results)
                    if page is not None:
                        loop.posted = response.post([page], token=response.token)
                        loop.drained = response.wait_drain(timeout=10.0)
            if response is not None and loop.drained is not None:
                loop.screened = response.wait_screen(timeout=180.0)
            if response is not None:
                loop.collect(response)
    finally:
        stop_file.touch()
    if failure:
        print(f"demo failed: {failure[0]}", file=sys.stderr)
        return 1
    ok = _report(results, want, plan.incident_dir)
    if want is not None:
        ok = _report_response(loop, page, results, stack_cls is not None) and ok
    return 0 if _report_checkpoints(results, want, resume_step) and ok else 1


@dataclasses.dataclass
class _DemoLoop:
    """What the demo's response half saw (filled while the responder runs, reported after)."""

    forged: int | None = None             # HTTP status of the page posted without the token
    posted: int | None = None             # HTTP status of the page the demo posted itself (no stack)
    drained: list[str] | None = None      # the recorder's argv of the first drain
    all_drains: list[list[str]] = dataclasses.field(default_factory=list)
    screened: bool = False
    strikes: list[Any] = dataclasses.field(default_factory=list)
    screens: list[Any] = dataclasses.field(default_factory=list)
    ledger_url: str = ""
    drill_device: int = 0
    cpu_workers: int = 0
    unauthorized: int = 0

    def collect(self, response: Any) -> None:
        from sdc_telemetry.ops.ledger import LedgerError

        self.all_drains = response.drained()
        self.ledger_url = response.ledger_url
        self.drill_device = response.drill_device
        self.cpu_workers = response.cpu_workers
        self.unauthorized = int(response.responder.health()["unauthorized"])
        try:
            self.strikes = response.responder.ledger.strikes()
            self.screens = response.responder.ledger.screens()
        except LedgerError as e:
            print(f"could not read the ledger: {e}", file=sys.stderr)


_FORGED_HOST = "victim-node"


def _forged_page() -> dict[str, Any]:
    """A well-formed critical SDC page, as a browser or anyone on the network could post it without the token."""
    from sdc_telemetry.ops.alerts import suspect_alert

    return suspect_alert("weights", {"host_name": _FORGED_HOST, "rank": 0, "local_rank": 0, "hw_id": "GPU-forged"},
                         "sdc-demo")


def _suspect_page(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The critical alert of the run's first incident (what the rules and the direct push page with)."""
    from sdc_telemetry.ops.alerts import suspect_alert

    incidents = results[0]["incidents"] if results else []
    if not incidents or not incidents[0]["suspects"] or incidents[0]["evidence"].get("ambiguous"):
        return None
    return suspect_alert(incidents[0]["check"], incidents[0]["suspects"][0], "sdc-demo")


def _report_response(loop: _DemoLoop, page: dict[str, Any] | None, results: list[dict[str, Any]],
                     stack: bool) -> bool:
    """Print the page, the refused forgery, the drain, the strike, the fleet and the screen; True when all
    happened as they should."""
    incidents = results[0]["incidents"] if results else []
    suspect = incidents[0]["suspects"][0] if incidents and incidents[0]["suspects"] else None
    ok = True
    print()
    if loop.forged == 401 and not any(_FORGED_HOST in d for d in loop.all_drains):
        print(f"responder refused a page posted without the bearer token: HTTP 401, nothing ran "
              f"({loop.unauthorized} unauthorized request(s) counted)")
    else:
        print(f"FAILED: a page without the bearer token got HTTP {loop.forged} (want 401)", file=sys.stderr)
        ok = False
    if page is not None:
        labels = page.get("labels", {})
        how = "received from Alertmanager" if stack else \
            f"posted to the responder with the bearer token as Alertmanager would (no stack here): HTTP {loop.posted}"
        print(f"page {how}: {labels.get('alertname')} [{labels.get('severity')}] host={labels.get('host_name')} "
              f"rank={labels.get('rank')} gpu={labels.get('hw_id')}: {page.get('annotations', {}).get('summary', '')}")
        ok = ok and (stack or loop.posted == 200)
    else:
        print("FAILED: no page " + ("arrived from Alertmanager in time" if stack else "to post: no suspect named"),
              file=sys.stderr)
        ok = False
    if suspect is None:
        return False
    host, gpu = suspect["host_name"], suspect["hw_id"]
    if loop.drained is not None and loop.drained[:2] == ["drain", host] and f"gpu={gpu}" in loop.drained:
        print(f"responder (authenticated) drained the node (recorder in place of scontrol): {' '.join(loop.drained)}")
    else:
        print(f"FAILED: the responder did not drain {host} in time (drains: {loop.all_drains})", file=sys.stderr)
        ok = False
    mine = [s for s in loop.strikes if s.hw_id == gpu]
    if len(mine) == 1 and mine[0].host_name == host:
        s = mine[0]
        print(f"ledger {loop.ledger_url}: strike 1 for GPU {gpu} on {host} ({s.alertname}, job {s.job}"
              + (f", check {s.check}" if s.check else "") + (f", step {s.step}" if s.step is not None else "")
              + "); a second strike within 90 days would run --replace-command")
    else:
        print(f"FAILED: the ledger holds {len(mine)} strike(s) for {gpu} (want 1): {loop.strikes}", file=sys.stderr)
        ok = False
    print(f"$ sdc-telemetry fleet --ledger {loop.ledger_url}")
    fleet(argparse.Namespace(ledger=loop.ledger_url, strike_window=90 * 86400.0, json=False))
    drill = f"cpu-worker:{loop.drill_device}"
    screens = [r for r in loop.screens if r.host_name == host]
    odd = [r for r in screens if not r.passed]
    print(f"screen after the drain (the responder's --screen-command: sdc-telemetry screen --cpu-workers "
          f"{loop.cpu_workers} --drill-fault {loop.drill_device} --ledger ... --host-name {host}): a DRILL, it flips "
          f"one bit in {drill}'s results, standing in for the faulty GPU of rank {loop.drill_device}:")
    for r in screens:
        print(f"  {r.device}  {r.hw_id}  {'consistent' if r.passed else 'ODD: ' + r.detail}")
    if loop.screened and [r.device for r in odd] == [drill]:
        print(f"screen verdict: odd device {drill} ({odd[0].hw_id}) named and recorded in the ledger: keep {host} "
              "out of service and replace that device after review")
    else:
        print(f"FAILED: the screen did not name {drill} (finished: {loop.screened}; results: {screens})",
              file=sys.stderr)
        ok = False
    return ok


def _report_checkpoints(results: list[dict[str, Any]], want: tuple[tuple[str, ...], int, int] | None,
                        resume_step: int | None) -> bool:
    """Verify a healthy run's checkpoints; after an incident, choose the checkpoint to resume from by the last
    passing audit (as ``sdc-telemetry verify-checkpoint PATH... --before-step N`` does). True when as planned."""
    from sdc_telemetry.ops.checkpoints import CheckpointError, choose_checkpoint, verify_checkpoint

    paths: list[str] = list(results[0].get("checkpoints") or []) if results else []
    saved = [p for p in paths if Path(p).exists()]
    print()
    if want is None:
        ok = bool(saved) == bool(paths)
        for path in saved:
            try:
                v = verify_checkpoint(path)
            except CheckpointError as e:
                print(f"{path}: unusable: {e}", file=sys.stderr)
                ok = False
                continue
            print(f"checkpoint of step {v.certificate.step}: {'intact' if v.intact else 'DOES NOT VERIFY'} "
                  f"({len(v.certificate.fingerprints)} tensors verified)")
            ok = ok and v.intact
        return ok
    incident_step = want[1]
    names = " ".join(Path(p).name for p in saved)
    print(f"$ sdc-telemetry verify-checkpoint {names} --before-step {incident_step}"
          + (f"   (in {Path(saved[0]).parent})" if saved else ""))
    choice = choose_checkpoint(saved, incident_step)
    for path, note in choice.notes:
        print(f"  {Path(path).name}: {note}")
    if choice.path is None or choice.certificate is None:
        why = "no replay audit passed before the incident" if choice.last_passing_audit is None else \
            f"none at or before the last passing audit (step {choice.last_passing_audit}) verifies"
        print(f"no checkpoint to resume from after the incident at step {incident_step}: {why}")
        return resume_step is None
    print(f"resume from {Path(choice.path).name} (step {choice.certificate.step}): the newest checkpoint at or "
          f"before the last replay audit that passed before the incident (step {choice.last_passing_audit}), "
          "verified intact. (A certificate proves that the replicas agreed; a compute fault spreads through the "
          "all-reduce and leaves them agreeing, so a later certified checkpoint is not trusted.)")
    if choice.certificate.step != resume_step:
        print(f"FAILED: the demo planned to resume from step {resume_step}", file=sys.stderr)
        return False
    return True


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
