"""``sdc-telemetry``: the demo, the responder that drains a paged node, the GPU strike ledger (``fleet``), node
screening (``screen``), checkpoint verification, and regeneration of the checked-in dashboards and alert rules."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sdc_telemetry.ops.demo_cli import add_demo_args, demo
from sdc_telemetry.ops.fleet_cli import add_fleet_args, add_respond_args, add_screen_args, fleet, respond, screen

__all__ = ["main"]


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


def verify_checkpoint(args: argparse.Namespace) -> int:
    from sdc_telemetry.ops.checkpoints import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    """The ``sdc-telemetry`` command line (the docs' command lines are checked against it)."""
    parser = argparse.ArgumentParser(prog="sdc-telemetry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_args(sub.add_parser("demo", help="multi-rank CPU training with an injected fault, the suspect named"))
    for kind in ("dashboards", "alerts"):
        p = sub.add_parser(kind, help=f"regenerate the checked-in {kind}")
        p.add_argument("--out", default=None, help=f"output directory (default: the repository's {kind}/)")
    add_respond_args(sub.add_parser("respond", help="Alertmanager webhook receiver that drains the paged node"))
    add_fleet_args(sub.add_parser("fleet", help="list the GPUs in the strike ledger, most strikes first"))
    add_screen_args(sub.add_parser("screen", help="seeded known-answer workloads on every local device, compared bit "
                                                  "for bit; names the odd device"))
    from sdc_telemetry.ops.checkpoints import add_arguments as _verify_args

    _verify_args(sub.add_parser("verify-checkpoint", help="check checkpoints against their SDC weight certificates, "
                                "or choose the one to resume from after an incident (--before-step)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
