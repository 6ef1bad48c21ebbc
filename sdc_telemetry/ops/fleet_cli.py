"""The fleet-side subcommands of ``sdc-telemetry``: ``respond`` (the Alertmanager webhook receiver that drains the
paged node), ``fleet`` (the GPUs in the strike ledger) and ``screen`` (seeded known-answer workloads on every local
device, compared bit for bit)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["add_fleet_args", "add_respond_args", "add_screen_args", "fleet", "respond", "screen"]


def _duration(option: str) -> Any:
    from sdc_telemetry.ops.labels import parse_duration

    def parse(text: str) -> float:
        try:
            return parse_duration(text, option)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def add_respond_args(p: argparse.ArgumentParser) -> None:
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
                   help="JSON file remembering the hosts acted on across restarts (default: named after the ledger: "
                        "<ledger file>.respond-state.json next to a SQLite ledger, respond-state-<hash of the URL>"
                        ".json in the state directory for PostgreSQL); two responders never share one")
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
    """The state file: --state, else named after the ledger, so that responders with different ledgers in one
    directory never share one (the responder also refuses a state file another responder holds)."""
    import hashlib

    from sdc_telemetry.ops.ledger import default_state_dir, sqlite_path

    if args.state:
        return str(args.state)
    db = sqlite_path(ledger_url)
    if db is not None:
        return str(db.with_name(db.name + ".respond-state.json"))
    digest = hashlib.sha256(ledger_url.encode()).hexdigest()[:12]
    return str(default_state_dir() / f"respond-state-{digest}.json")


def _journal_path(state: str, ledger_url: str) -> str | None:
    """A shared (PostgreSQL) ledger gets a local journal next to the state file: strikes survive its outages."""
    return None if ledger_url.startswith("sqlite://") else state.removesuffix(".json") + ".journal.sqlite3"


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
    state = _state_path(args, ledger_url)
    try:
        host, port = parse_listen(args.listen)
        ledger = Ledger(ledger_url, journal=_journal_path(state, ledger_url))
    except (ValueError, LedgerError) as e:
        return fail(str(e))
    try:
        responder = Responder(args.template, host=host, port=port, max_actions_per_hour=args.max_actions_per_hour,
                              dry_run=args.dry_run, state_file=state, timeout_s=args.timeout,
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


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ledger", default=None, metavar="URL",
                   help="sqlite:///PATH or postgresql://... (default: the responder's default ledger)")
    p.add_argument("--strike-window", type=_duration("--strike-window"), default="90d", metavar="DURATION",
                   help="window of the 'in window' strike count (default: 90d)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per GPU, most strikes first)")


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def fleet(args: argparse.Namespace) -> int:
    from sdc_telemetry.ops.labels import safe_text
    from sdc_telemetry.ops.ledger import Ledger, LedgerError, default_ledger_url

    url = args.ledger or default_ledger_url()
    try:
        with Ledger(url, read_only=True) as ledger:  # listing creates and changes nothing
            gpus = ledger.fleet(window_s=args.strike_window)
            shown = ledger.redacted_url
    except LedgerError as e:
        print(f"sdc-telemetry fleet: {safe_text(str(e))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([g.to_dict() for g in gpus], indent=1))  # json escapes control characters itself
        return 0
    if not gpus:
        print(f"no GPU recorded in {safe_text(shown)} (no strike, no screen)")
        return 0
    days = args.strike_window / 86400

    def verdict(g: Any) -> str:
        if g.strikes_in_window >= 2:
            return "REPLACE"
        if g.strikes or g.last_screen == "fail":
            return "watch"
        return "ok"

    header = ("hw_id", "host_name", f"strikes({days:g}d)", "strikes", "last strike (UTC)", "last alert", "screens",
              "last screen", "verdict")
    rows = [tuple(safe_text(c) for c in (
        g.hw_id, g.host_name, str(g.strikes_in_window), str(g.strikes), _when(g.last_strike_at),
        g.last_alertname or "-", f"{g.screens_passed} pass / {g.screens_failed} fail",
        f"{g.last_screen} {_when(g.last_screen_at)}" if g.last_screen else "-", verdict(g))) for g in gpus]
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    for r in (header, *rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def add_screen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device-type", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: every CUDA device when present, else CPU worker processes (default: %(default)s)")
    p.add_argument("--cpu-workers", type=int, default=3,
                   help="CPU worker processes standing in for devices without CUDA (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions of every workload (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workloads' inputs (default: %(default)s)")
    p.add_argument("--drill-fault", default=None, metavar="DEVICE",
                   help="flip one bit in this device's results (index or name, e.g. 1 or cpu-worker:1): a drill")
    p.add_argument("--drill-kind", choices=("bitflip", "hang", "die"), default="bitflip",
                   help="what --drill-fault does to its device: flip a bit, hang its worker, or kill it "
                        "(default: %(default)s)")
    p.add_argument("--worker-timeout", type=_duration("--worker-timeout"), default="30m", metavar="DURATION",
                   help="how long each device's worker may take; a worker still running then is killed and its "
                        "device named (default: %(default)s)")
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
                                progress=progress, worker_timeout_s=args.worker_timeout,
                                drill_kind=args.drill_kind)
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
