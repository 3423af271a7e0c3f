"""The ``audits`` section of ``meshnode status``: what this head's audits by replica found.

Read at every report from the head's driver (meshnode.head.auditor): the rate, how many
generations were audited and why others were not, disputes, and every node convicted with
the verdict its evidence gives and the evidence itself (the JSON ``meshnode audit verify`` reads:
``meshnode status --json | jq '.sections.audits.convicted[0].evidence' > evidence.json``).
meshnode.app.status prints it without importing this module.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from meshnode.audit.evidence import check_evidence
from meshnode.head.driver import GenerationDriver
from meshnode.identity import short_id

AUDITS_SECTION = "audits"


def audit_section(driver: GenerationDriver) -> dict[str, Any]:
    stats = driver.auditor.stats
    return {
        "rate": driver.options.audit_rate,
        "audited": stats.audited,
        "without_replica": stats.without_replica,
        "not_replayable": stats.not_replayable,
        "skipped_busy": stats.skipped_busy,
        "failed": stats.failed,
        "units_compared": stats.units_compared,
        "checked_within_tolerance": stats.checked_within_tolerance,
        "disputes": stats.disputes,
        "undecided": stats.undecided,
        "convicted": [
            {
                "node": short_id(node_id),
                "node_id": node_id.hex(),
                "verdict": check_evidence(evidence).detail,
                # The evidence file's own JSON: `meshnode audit verify` reads it as it is.
                "evidence": json_format.MessageToDict(evidence),
            }
            for node_id, evidence in driver.convicted.items()
        ],
    }


__all__ = ["AUDITS_SECTION", "audit_section"]
