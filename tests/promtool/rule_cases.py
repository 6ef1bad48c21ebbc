"""promtool unit tests of the alert and recording rules, written to ``alerts/sdc-rules.test.yml``.

    python -m tests.promtool.rule_cases          # regenerate after changing sdc_telemetry/alerts.py
    promtool test rules alerts/sdc-rules.test.yml

The expected labels and annotations of every critical alert come from ``alerts.suspect_alert()``, the function the
direct push uses: promtool passing proves the pushed alert and the rule's alert are the same alert.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sdc_telemetry.ops import alerts
from sdc_telemetry.sinks.metrics import family

ROOT = Path(__file__).resolve().parents[2]
TESTS_PATH = ROOT / "alerts" / alerts.TESTS_FILE

JOB = "llm"
STEPS = family("sdc_steps_total").name
CHECKS = family("sdc_checks_total").name
SUSPECT = family("sdc_suspect").name
AMBIGUOUS = family("sdc_suspect_ambiguous").name
PAGER_FAILURES = family("sdc_pager_failures_total").name
LAST_RUN = family("sdc_check_last_run_timestamp_seconds").name
NONFINITE = family("sdc_grad_nonfinite_total").name
NORM = family("sdc_grad_norm").name
CLOSED = family("sdc_monitor_closed").name
WEIGHT_MISMATCHES = family("sdc_weight_fingerprint_mismatches_total").name
ECC = family("hw_errors_total").name
XID = family("gpu_xid_errors_total").name
ALERT_NAMES = tuple(dict.fromkeys(r.name for r in alerts.RULES))
CRITICAL = tuple(dict.fromkeys(r.name for r in alerts.RULES if r.severity == "critical"))


def host_of(rank: int) -> str:
    return "node-a" if rank < 2 else "node-b"


def ident(rank: int, host: str | None = None) -> dict[str, str]:
    """The identity labels an alert about ``rank`` carries."""
    return {"service_name": JOB, "host_name": host or host_of(rank), "rank": str(rank), "local_rank": str(rank % 2),
            "hw_id": f"GPU-{rank:08d}-aaaa-bbbb-cccc-dddddddddddd"}


def scraped(rank: int, host: str | None = None) -> dict[str, str]:
    """Every label a scraped SDC series of ``rank`` carries."""
    i = ident(rank, host)
    return {**i, "service_instance_id": f"{i['host_name']}-rank{rank}", "job": alerts.SCRAPE_JOB,
            "instance": f"{i['host_name']}:{9860 + int(i['local_rank'])}"}


def target(rank: int) -> dict[str, str]:
    s = scraped(rank)
    return {"job": s["job"], "instance": s["instance"]}


def series(name: str, labels: Mapping[str, str], values: str) -> dict[str, str]:
    inner = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{inner}}}", "values": values}


def expect(name: str, labels: Mapping[str, str], value: str = "") -> dict[str, Any]:
    """What promtool should report for a warning rule firing with ``labels`` (its output labels) and ``value``."""
    rule = next(r for r in alerts.RULES if r.name == name)
    all_labels = {**rule.rule_labels(), **labels}
    return {"exp_labels": all_labels,
            "exp_annotations": {k: alerts.render_template(v, all_labels, value)
                                for k, v in rule.annotations().items()}}


def expect_suspect(check: str, rank: int, *, ambiguous: bool = False) -> dict[str, Any]:
    """The critical alert for a suspect rank (with ``ambiguous``: the warning for an ambiguous suspect), exactly as
    the direct push builds it."""
    pushed = alerts.suspect_alert(check, ident(rank), JOB, ambiguous=ambiguous)
    labels = {k: v for k, v in pushed["labels"].items() if k != "alertname"}
    return {"exp_labels": labels, "exp_annotations": pushed["annotations"]}


def at(t: str, name: str, *alerts_: dict[str, Any]) -> dict[str, Any]:
    return {"eval_time": t, "alertname": name, "exp_alerts": list(alerts_)}


def quiet(names: tuple[str, ...], *times: str) -> list[dict[str, Any]]:
    return [at(t, n) for t in times for n in names]


def healthy_rank(rank: int, minutes: int) -> list[dict[str, str]]:
    """Every SDC and GPU family a healthy rank exports, sampled every minute (one step per second)."""
    lab = scraped(rank)
    out = [series("up", target(rank), f"1x{minutes}"), series(STEPS, lab, f"0+60x{minutes}"),
           series(CLOSED, lab, f"0x{minutes}"), series(WEIGHT_MISMATCHES, lab, f"0x{minutes}")]
    if rank == 0:  # the writer rank pushes pages itself (alertmanager_url)
        out.append(series(PAGER_FAILURES, lab, f"0x{minutes}"))
    for check in alerts.STALE_AFTER:
        out.append(series(LAST_RUN, {**lab, "check": check}, f"0+60x{minutes}"))
        out.append(series(SUSPECT, {**lab, "check": check}, f"0x{minutes}"))
        out.append(series(AMBIGUOUS, {**lab, "check": check}, f"0x{minutes}"))
        out.append(series(CHECKS, {**lab, "check": check, "result": "pass"}, f"0+60x{minutes}"))
        # A skipped run now and then (a rank not measured yet) is not a failing check.
        out.append(series(CHECKS, {**lab, "check": check, "result": "skipped"}, f"1+1x{minutes}"))
    for phase in ("local", "reduced"):
        out.append(series(NONFINITE, {**lab, "phase": phase}, f"0x{minutes}"))
        out.append(series(NORM, {**lab, "phase": phase}, f"1x{minutes}"))
    gpu = {k: lab[k] for k in ("service_name", "host_name", "rank", "local_rank", "hw_id", "job", "instance")}
    out.append(series(ECC, {**gpu, "hw_type": "gpu", "error_type": "corrected"}, f"0+3x{minutes}"))
    out.append(series(ECC, {**gpu, "hw_type": "gpu", "error_type": "uncorrected"}, f"0x{minutes}"))
    return out


def document() -> dict[str, Any]:
    tests: list[dict[str, Any]] = []

    def case(name: str, input_series: list[dict[str, str]], checks: list[dict[str, Any]],
             exprs: list[dict[str, Any]] | None = None) -> None:
        test: dict[str, Any] = {"name": name, "interval": "1m", "input_series": input_series,
                                "alert_rule_test": checks}
        if exprs:
            test["promql_expr_test"] = exprs
        tests.append(test)

    healthy = [s for r in range(4) for s in healthy_rank(r, 120)]
    case("a healthy job pages nothing and its rollups count ranks, full coverage and no suspect", healthy,
         quiet(ALERT_NAMES, "5m", "30m", "1h", "119m"),
         [{"expr": "sdc:ranks:count", "eval_time": "10m",
           "exp_samples": [{"labels": f'sdc:ranks:count{{service_name="{JOB}", host_name="{h}"}}', "value": 2}
                           for h in ("node-a", "node-b")]},
          # 60 passes and 1 skipped run a minute: 98.4% of the due runs reached a verdict.
          {"expr": 'round(sdc:checks:coverage5m{check="weights"}, 0.001)', "eval_time": "10m",
           "exp_samples": [{"labels": f'{{service_name="{JOB}", check="weights"}}', "value": 0.984}]},
          {"expr": "sdc:suspect_ranks:count", "eval_time": "10m", "exp_samples": []}])

    # -- one critical per check, for the suspect rank only, with the labels and annotations the push sends
    case("a weight mismatch seen in one scrape pages the suspect and lasts the event window",
         [series(SUSPECT, {**scraped(2), "check": "weights"}, "0x10 1 stale"),
          series(SUSPECT, {**scraped(1), "check": "weights"}, "0x25")],
         [at("10m", "SDCWeightFingerprintMismatch"),
          at("11m", "SDCWeightFingerprintMismatch", expect_suspect("weights", 2)),
          at("25m", "SDCWeightFingerprintMismatch", expect_suspect("weights", 2)),
          at("27m", "SDCWeightFingerprintMismatch")])
    for check, name in alerts.SUSPECT_ALERTS.items():
        if check == "weights":
            continue
        others = [a for a in CRITICAL if a != name]
        case(f"a {check} suspect pages {name} naming the rank, and nothing else",
             [series(SUSPECT, {**scraped(3), "check": check}, "0x5 1x20"),
              series(SUSPECT, {**scraped(0), "check": check}, "0x25")],
             [at("5m", name), at("6m", name, expect_suspect(check, 3)), *quiet(tuple(others), "6m", "20m")])

    # -- ambiguous verdicts: the same alert name as a warning with ambiguous="true", never the critical
    for check, name in alerts.SUSPECT_ALERTS.items():
        case(f"an ambiguous {check} suspect warns {name} with ambiguous=\"true\" and never fires it critical",
             [series(AMBIGUOUS, {**scraped(1), "check": check}, "0x5 1x20"),
              series(SUSPECT, {**scraped(1), "check": check}, "0x25"),
              series(AMBIGUOUS, {**scraped(0), "check": check}, "0x25")],
             # promtool compares every alert of the name: the lone warning proves no critical fires beside it.
             [at("5m", name), at("6m", name, expect_suspect(check, 1, ambiguous=True)),
              at("20m", name, expect_suspect(check, 1, ambiguous=True)),
              *quiet(tuple(a for a in CRITICAL if a != name), "6m", "20m")])
    case("an unambiguous and an ambiguous suspect of one check: a critical for the one, a warning for the other",
         [series(SUSPECT, {**scraped(3), "check": "weights"}, "0x5 1x20"),
          series(AMBIGUOUS, {**scraped(1), "check": "weights"}, "0x5 1x20")],
         [at("6m", "SDCWeightFingerprintMismatch", expect_suspect("weights", 1, ambiguous=True),
             expect_suspect("weights", 3))])

    # -- the direct push failing
    case("failed direct pages warn SDCPagerFailing for the writer rank for the event window, then clear",
         [series(PAGER_FAILURES, scraped(0), "0x10 1 2 3x40"),
          series(PAGER_FAILURES, scraped(1), "0x50")],
         [at("10m", "SDCPagerFailing"),
          at("11m", "SDCPagerFailing", expect("SDCPagerFailing", ident(0))),
          at("20m", "SDCPagerFailing", expect("SDCPagerFailing", ident(0))),
          at("30m", "SDCPagerFailing"), *quiet(CRITICAL, "11m")])
    case("a pager failure counter born by its first failure warns SDCPagerFailing",
         [series(PAGER_FAILURES, scraped(2), "_x5 1x30")],
         [at("4m", "SDCPagerFailing"), at("6m", "SDCPagerFailing", expect("SDCPagerFailing", ident(2)))])

    # -- numerics: NaN on every rank pages nobody, warns the job once it persists
    nan = [s for r in range(4) for s in healthy_rank(r, 60) if NONFINITE not in s["series"]]
    for r in range(4):
        for phase in ("local", "reduced"):
            nan.append(series(NONFINITE, {**scraped(r), "phase": phase}, "0x10 0+60x50"))
    case("NaN on every rank step after step warns SDCTrainingNonFinite for the job and pages no node",
         nan,
         [at("20m", "SDCTrainingNonFinite"),
          at("30m", "SDCTrainingNonFinite", expect("SDCTrainingNonFinite", {"service_name": JOB}, "")),
          *quiet(CRITICAL, "15m", "30m", "55m")])
    overflow = [s for r in range(4) for s in healthy_rank(r, 60) if NONFINITE not in s["series"]]
    for r in range(4):
        for phase in ("local", "reduced"):
            overflow.append(series(NONFINITE, {**scraped(r), "phase": phase}, "0x20 1x40"))
    case("a single loss-scale overflow on every rank warns nobody", overflow,
         quiet(("SDCTrainingNonFinite", *CRITICAL), "21m", "30m", "50m"))

    # -- a check that cannot run
    broken = [s for r in range(2) for s in healthy_rank(r, 90) if 'check="replay"' not in s["series"]
              or LAST_RUN in s["series"]]
    broken.append(series(CHECKS, {**scraped(1), "check": "replay", "result": "error"}, "1+1x90"))
    broken.append(series(SUSPECT, {**scraped(1), "check": "replay"}, "0x90"))
    # Rank 0's replay errs now and then but also passes: not failing.
    broken.append(series(CHECKS, {**scraped(0), "check": "replay", "result": "error"}, "0+1x90"))
    broken.append(series(CHECKS, {**scraped(0), "check": "replay", "result": "pass"}, "0+5x90"))
    failing = expect("SDCCheckFailing", {**ident(1), "check": "replay"})
    case("a replay broken on every audit (errors, no pass) warns SDCCheckFailing after 30 minutes, pages nobody",
         broken,
         [at("29m", "SDCCheckFailing"), at("31m", "SDCCheckFailing", failing),
          at("80m", "SDCCheckFailing", failing), *quiet(CRITICAL, "31m", "80m")])

    # -- endpoints that go away
    clean = [series("up", target(2), "1x10 0x20"), series(STEPS, scraped(2), "0+60x10 stale"),
             series(CLOSED, scraped(2), "0x8 1x1 stale")]
    case("a job that ended with close() (sdc_monitor_closed 1 scraped) pages nobody when its endpoint goes",
         clean, quiet(("SDCExporterDown",), "12m", "15m", "30m"))
    vanished = [series("up", target(2), "1x10 0x20"), series(STEPS, scraped(2), "0+60x10 stale"),
                series(CLOSED, scraped(2), "0x10 stale"),
                # The same port reused by a new process that ends cleanly: its closed=1 decides, not the old 0.
                series("up", target(1), "1x30"),
                series(CLOSED, {**scraped(1), "service_instance_id": "old"}, "0x5 stale"),
                series(CLOSED, scraped(1), "_x6 0x10 1x2 stale"),
                series("up", {"job": alerts.SCRAPE_JOB, "instance": "node-a:9861"}, "1x20 0x10")]
    down = expect("SDCExporterDown", {**target(2), **ident(2)})
    case("an endpoint that vanished while monitoring (sdc_monitor_closed 0) warns SDCExporterDown with its identity",
         vanished,
         [at("12m", "SDCExporterDown"), at("14m", "SDCExporterDown", down),
          at("30m", "SDCExporterDown", down), *quiet(CRITICAL, "14m")])

    stalled = [series(STEPS, scraped(2), "0+60x90"),
               series(LAST_RUN, {**scraped(2), "check": "grad_local"}, "0+60x90"),
               series(LAST_RUN, {**scraped(2), "check": "weights"}, "0+60x10 600x80"),
               series(STEPS, scraped(1), "0+60x10 600x80"),
               series(LAST_RUN, {**scraped(1), "check": "weights"}, "0+60x10 600x80")]
    case("a check whose last run ages while steps advance warns; a paused job does not", stalled,
         [at("44m", "SDCChecksStalled"),
          at("46m", "SDCChecksStalled", expect("SDCChecksStalled", {**ident(2), "check": "weights"}, "36m 0s"))])

    gpu = {k: scraped(2)[k] for k in ("service_name", "host_name", "rank", "local_rank", "hw_id", "job", "instance")}
    case("uncorrectable ECC errors warn; corrected ones do not",
         [series(ECC, {**gpu, "hw_type": "gpu", "error_type": "uncorrected"}, "0x5 2x20"),
          series(ECC, {**gpu, "hw_type": "gpu", "error_type": "corrected"}, "0+10x25")],
         [at("5m", "GPUUncorrectableECCErrors"),
          at("6m", "GPUUncorrectableECCErrors", expect("GPUUncorrectableECCErrors", ident(2), "2"))])
    case("an XID warns for the event window, also when its counter is born by the event",
         [series(XID, {**gpu, "xid": "79"}, "_x5 1x40"), series(XID, {**scraped(1), "xid": "13"}, "0x30 1x10")],
         [at("4m", "GPUXidErrors"), at("6m", "GPUXidErrors", expect("GPUXidErrors", {**ident(2), "xid": "79"})),
          at("25m", "GPUXidErrors"),
          at("32m", "GPUXidErrors", expect("GPUXidErrors", {**ident(1), "xid": "13"}))])

    return {"rule_files": [alerts.RULES_FILE], "evaluation_interval": "1m", "tests": tests}


def text() -> str:
    """The text of ``alerts/sdc-rules.test.yml``."""
    return (alerts.HEADER.replace("sdc_telemetry.ops.alerts (sdc-telemetry alerts)", "tests/promtool/rule_cases.py")
            + f"# Run: promtool test rules alerts/{alerts.TESTS_FILE}\n" + alerts.to_yaml(document()))


def main(argv: list[str] | None = None) -> int:
    path = Path(argv[0]) if argv else TESTS_PATH
    path.write_text(text(), encoding="utf-8")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
