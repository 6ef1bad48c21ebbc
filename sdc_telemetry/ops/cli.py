"""``sdc-telemetry``: the demo, the responder that drains a paged node, the GPU strike ledger (``fleet``), node
screening (``screen``), checkpoint verification, and regeneration of the checked-in dashboards and alert rules."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
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


def _duration(option: str) -> Any:
    from sdc_telemetry.ops.respond import parse_duration

    def parse(text: str) -> float:
        try:
            return parse_duration(text, option)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _respond_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, metavar="HOST:PORT",
                   help="where Alertmanager's webhook posts (POST /alerts or /; GET /healthz, GET /metrics)")
    p.add_argument("--command", required=True, metavar="TEMPLATE", dest="template",
                   help="command run once per paged host, split like a shell line, run without a shell; "
                        "placeholders {host_name} {rank} {hw_id} {alertname}")
    auth = p.add_mutually_exclusive_group()
    auth.add_argument("--bearer-token-file", metavar="FILE", default=None,
                      help="file holding the token every POST must carry as 'Authorization: Bearer <token>' "
                           "(Alertmanager: http_config.authorization.credentials_file)")
    auth.add_argument("--insecure-no-auth", action="store_true",
                      help="run without authentication (a bench on a trusted network only)")
    p.add_argument("--tls-cert", metavar="PEM", default=None, help="serve HTTPS with this certificate (chain)")
    p.add_argument("--tls-key", metavar="PEM", default=None, help="the private key of --tls-cert")
    p.add_argument("--max-actions-per-hour", type=int, default=3,
                   help="refuse (and log) further actions past this many in any hour (default: %(default)s)")
    p.add_argument("--reacquire-after", type=_duration("--reacquire-after"), default="24h", metavar="DURATION",
                   help="a host acted on is not acted on again for this long, across restarts (default: 24h)")
    p.add_argument("--dry-run", action="store_true", help="log the command instead of running it (no strike)")
    p.add_argument("--state", default=None, metavar="FILE",
                   help="JSON file remembering the hosts acted on across restarts (default: respond-state.json next "
                        "to a SQLite ledger, else in the state directory)")
    p.add_argument("--ledger", default=None, metavar="URL",
                   help="GPU strike ledger: sqlite:///PATH or postgresql://USER@HOST:PORT/DB (default: "
                        "sqlite:///<state dir>/ledger.sqlite3; state dir: $SDC_STATE_DIR, /var/lib/sdc-telemetry as "
                        "root, else ~/.local/state/sdc-telemetry)")
    p.add_argument("--strike-window", type=_duration("--strike-window"), default="90d", metavar="DURATION",
                   help="a GPU's second strike within this window runs --replace-command (default: 90d)")
    p.add_argument("--replace-command", default=None, metavar="TEMPLATE",
                   help="run instead of --command on a GPU's second strike within --strike-window (same "
                        "placeholders and rules)")
    p.add_argument("--screen-command", default=None, metavar="TEMPLATE",
                   help="run in the background after a successful action, e.g. 'srun -w {host_name} sdc-telemetry "
                        "screen --ledger URL' (exit 0 pass, 1 odd device found)")
    p.add_argument("--screen-timeout", type=_duration("--screen-timeout"), default="1h", metavar="DURATION",
                   help="how long a --screen-command may run (default: 1h)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per command run (default: %(default)s)")
    p.add_argument("--idle-timeout", type=float, default=10.0,
                   help="seconds a connection may sit idle or mid-request before it is closed (default: %(default)s)")


def _state_path(args: argparse.Namespace, ledger_url: str) -> str:
    from sdc_telemetry.ops.ledger import default_state_dir, sqlite_path

    if args.state:
        return str(args.state)
    db = sqlite_path(ledger_url)
    return str((db.parent if db is not None else default_state_dir()) / "respond-state.json")


def respond(args: argparse.Namespace) -> int:
    import logging
    import signal

    from sdc_telemetry.ops.ledger import Ledger, LedgerError, default_ledger_url
    from sdc_telemetry.ops.respond import Responder, TemplateError, parse_listen

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    def fail(msg: str) -> int:
        print(f"sdc-telemetry respond: {msg}", file=sys.stderr)
        return 2

    if not args.bearer_token_file and not args.insecure_no_auth:
        return fail("refusing to start without authentication: pass --bearer-token-file FILE (the token "
                    "Alertmanager sends with http_config.authorization.credentials_file), or --insecure-no-auth "
                    "for a bench on a trusted network")
    token = None
    if args.bearer_token_file:
        try:
            token = Path(args.bearer_token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            return fail(f"cannot read --bearer-token-file {args.bearer_token_file}: {e}")
        if not token:
            return fail(f"--bearer-token-file {args.bearer_token_file} is empty")
        if any(c.isspace() for c in token):
            return fail(f"--bearer-token-file {args.bearer_token_file}: the token may not contain whitespace")
        mode = Path(args.bearer_token_file).stat().st_mode
        if mode & 0o077:
            logging.getLogger("sdc_telemetry").warning(
                "sdc responder: --bearer-token-file %s is readable by group or others (chmod 600 it)",
                args.bearer_token_file)
    ledger_url = args.ledger or default_ledger_url()
    try:
        host, port = parse_listen(args.listen)
        ledger = Ledger(ledger_url)
    except (ValueError, LedgerError) as e:
        return fail(str(e))
    try:
        responder = Responder(args.template, host=host, port=port, max_actions_per_hour=args.max_actions_per_hour,
                              dry_run=args.dry_run, state_file=_state_path(args, ledger_url), timeout_s=args.timeout,
                              bearer_token=token, insecure_no_auth=args.insecure_no_auth, tls_cert=args.tls_cert,
                              tls_key=args.tls_key, reacquire_after_s=args.reacquire_after, ledger=ledger,
                              replace_command=args.replace_command, strike_window_s=args.strike_window,
                              screen_command=args.screen_command, screen_timeout_s=args.screen_timeout,
                              idle_timeout_s=args.idle_timeout)
    except TemplateError as e:
        ledger.close()
        return fail(str(e))
    except ValueError as e:
        ledger.close()
        return fail(str(e).replace("max_actions_per_hour", "--max-actions-per-hour")
                    .replace("idle_timeout_s", "--idle-timeout").replace("timeout_s", "--timeout"))
    except OSError as e:
        ledger.close()
        return fail(f"cannot listen on {args.listen}: {e}")
    if args.insecure_no_auth and host not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger("sdc_telemetry").warning(
            "sdc responder: NO AUTHENTICATION on %s: anyone who can reach it can drain nodes", args.listen)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(f"sdc-telemetry respond: listening on {responder.url} (POST /alerts, GET /healthz, GET /metrics)",
          flush=True)
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        responder.close()
        ledger.close()
    return 0


def _fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ledger", default=None, metavar="URL",
                   help="sqlite:///PATH or postgresql://... (default: the responder's default ledger)")
    p.add_argument("--strike-window", type=_duration("--strike-window"), default="90d", metavar="DURATION",
                   help="window of the 'in window' strike count (default: 90d)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per GPU, most strikes first)")


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def fleet(args: argparse.Namespace) -> int:
    from sdc_telemetry.ops.ledger import Ledger, LedgerError, default_ledger_url

    url = args.ledger or default_ledger_url()
    try:
        with Ledger(url) as ledger:
            gpus = ledger.fleet(window_s=args.strike_window)
            shown = ledger.redacted_url
    except LedgerError as e:
        print(f"sdc-telemetry fleet: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([g.to_dict() for g in gpus], indent=1))
        return 0
    if not gpus:
        print(f"no strikes recorded in {shown}")
        return 0
    days = args.strike_window / 86400
    header = ("hw_id", "host_name", f"strikes({days:g}d)", "strikes", "last strike (UTC)", "last alert", "screens",
              "verdict")
    rows = [(g.hw_id, g.host_name, str(g.strikes_in_window), str(g.strikes), _when(g.last_strike_at),
             g.last_alertname or "-", f"{g.screens_passed} pass / {g.screens_failed} fail",
             "REPLACE" if g.strikes_in_window >= 2 else "watch") for g in gpus]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _screen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-type", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: every CUDA device when present, else CPU worker processes (default: %(default)s)")
    p.add_argument("--cpu-workers", type=int, default=3,
                   help="CPU worker processes standing in for devices without CUDA (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of every workload (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads' inputs (default: %(default)s)")
    p.add_argument("--drill-fault", default=None, metavar="DEVICE",
                   help="flip one bit in this device's results (index or name, e.g. 1 or cpu-worker:1): a drill")
    p.add_argument("--dcgm", action="store_true", help="also run 'dcgmi diag -r 3' (where dcgmi is installed)")
    p.add_argument("--host-name", default=None,
                   help="host name recorded in the ledger (default: $SDC_HOST_NAME, else the machine's)")
    ledger = p.add_mutually_exclusive_group()
    ledger.add_argument("--ledger", default=None, metavar="URL",
                        help="ledger to record the result in (default: the responder's default ledger)")
    ledger.add_argument("--no-ledger", action="store_true", help="record nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def screen(args: argparse.Namespace) -> int:
    from sdc_telemetry.ops.ledger import Ledger, LedgerError, default_ledger_url
    from sdc_telemetry.ops.screen import ScreenError, run_dcgm, run_screen

    def fail(msg: str) -> int:
        print(f"sdc-telemetry screen: {msg}", file=sys.stderr)
        return 2

    ledger = None
    if not args.no_ledger:
        try:
            ledger = Ledger(args.ledger or default_ledger_url())
        except LedgerError as e:
            return fail(f"{e} (or pass --no-ledger)")
    progress = None if args.json else (lambda msg: print(f"sdc-telemetry screen: {msg}", flush=True))
    try:
        try:
            report = run_screen(device_type=args.device_type, cpu_workers=args.cpu_workers, repeat=args.repeat,
                                seed=args.seed, drill_fault=args.drill_fault, host_name=args.host_name,
                                progress=progress)
        except ScreenError as e:
            return fail(str(e).replace("cpu_workers", "--cpu-workers").replace("repeat", "--repeat")
                        .replace("seed", "--seed"))
        if args.dcgm:
            if progress:
                progress("running dcgmi diag -r 3")
            report.dcgm = run_dcgm(3)
            if report.dcgm["rc"] is None:
                print(f"sdc-telemetry screen: --dcgm: {report.dcgm['output']}; DCGM diagnostics skipped",
                      file=sys.stderr)
        recorded = None
        if ledger is not None:
            dcgm_note = "" if report.dcgm is None or report.dcgm["rc"] in (None, 0) else \
                f"; dcgmi diag -r 3 exited {report.dcgm['rc']}"
            try:
                for d in report.devices:
                    ledger.record_screen(host_name=report.host_name, device=d.device, hw_id=d.hw_id,
                                         passed=d.passed and not dcgm_note,
                                         detail=("; ".join(d.problems) or "consistent") + dcgm_note)
                recorded = ledger.redacted_url
            except LedgerError as e:
                print(f"sdc-telemetry screen: could not record the result: {e}", file=sys.stderr)
                if report.passed:
                    return 2
    finally:
        if ledger is not None:
            ledger.close()
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        _print_screen(report, recorded)
    return 0 if report.passed else 1


def _print_screen(report: Any, recorded: str | None) -> None:
    from sdc_telemetry.ops.screen import WORKLOADS

    print(f"{len(report.devices)} device(s) on {report.host_name}, {len(WORKLOADS)} workloads x {report.repeat} "
          f"repetition(s), seed {report.seed}, compared bit for bit:")
    for d in report.devices:
        verdict = "consistent" if d.passed else ("ODD: " if d.device in report.odd else "UNDECIDED: ") + \
            "; ".join(d.problems)
        print(f"  {d.device}  {d.hw_id}  {verdict}")
    if report.dcgm is not None and report.dcgm["rc"] is not None:
        print(f"dcgmi diag -r 3: exit {report.dcgm['rc']}" + ("" if report.dcgm["rc"] == 0 else
                                                             f"\n{report.dcgm['output'].strip()}"))
    for name in report.odd:
        hw = next(d.hw_id for d in report.devices if d.device == name)
        print(f"ODD DEVICE: {name} ({hw}): keep the node out of service and replace this device after review")
    if report.undecided:
        print(f"UNDECIDED: {', '.join(report.undecided)} disagree with no majority: screen them against a known-good "
              "device")
    if recorded:
        print(f"recorded in the ledger {recorded} (a pass never clears strikes)")
    print("result: " + ("PASS: every device agrees, bit for bit" if report.passed else "FAIL"))


def verify_checkpoint(args: argparse.Namespace) -> int:
    from sdc_telemetry.ops.checkpoints import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sdc-telemetry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _demo_args(sub.add_parser("demo", help="multi-rank CPU training with an injected fault, the suspect named"))
    for kind in ("dashboards", "alerts"):
        p = sub.add_parser(kind, help=f"regenerate the checked-in {kind}")
        p.add_argument("--out", default=None, help=f"output directory (default: the repository's {kind}/)")
    _respond_args(sub.add_parser("respond", help="Alertmanager webhook receiver that drains the paged node"))
    _fleet_args(sub.add_parser("fleet", help="list the GPUs in the strike ledger, most strikes first"))
    _screen_args(sub.add_parser("screen", help="seeded known-answer workloads on every local device, compared bit "
                                               "for bit; names the odd device"))
    from sdc_telemetry.ops.checkpoints import add_arguments as _verify_args

    _verify_args(sub.add_parser("verify-checkpoint", help="check checkpoints against their SDC weight certificates, "
                                "or choose the one to resume from after an incident (--before-step)"))
    args = parser.parse_args(argv)
    try:
        return _dispatch(args)
    except ModuleNotFoundError as e:
        if e.name not in _OPS_EXTRA:
            raise
        print(f"sdc-telemetry {args.command} needs {e.name}, part of the ops tooling: pip install "
              "'sdc_telemetry[ops]'", file=sys.stderr)
        return 2


# Modules of the `ops` extra: the rule and dashboard generators and the local stack need them, training never does.
_OPS_EXTRA = ("yaml", "grafanalib")


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return demo(args)
    if args.command == "respond":
        return respond(args)
    if args.command == "fleet":
        return fleet(args)
    if args.command == "screen":
        return screen(args)
    if args.command == "verify-checkpoint":
        return verify_checkpoint(args)
    return regenerate(args.command, args.out)


if __name__ == "__main__":
    sys.exit(main())


