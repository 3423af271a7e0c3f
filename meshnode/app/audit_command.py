"""``meshnode audit verify FILE``: check audit evidence offline, with nothing but the file.

Exit status: 0 the evidence convicts its accused; 1 it does not (a fault, or a hop with inexact
numerics only checked within tolerance); 2 the file cannot be read or is not evidence at all.
The checks are :mod:`meshnode.audit.evidence`'s; this module only reads the file and prints the
verdict and, for a file that is evidence, its digest: the one ``meshnode remove --evidence`` cites
in the removal's reason and ``meshnode status`` shows for evidence held, so an admin can match a
removal to its evidence. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from meshnode.app.member_commands import EVIDENCE_REASON_PREFIX
from meshnode.commandline.cli_error import CliError
from meshnode.gen.meshnode.v1.audit_pb2 import AuditEvidence

EXIT_CONVICTED = 0
EXIT_NOT_EVIDENCE = 1
EXIT_UNREADABLE = 2


def run_verify(args: argparse.Namespace) -> int:
    # Imported here: the digests need numpy, which reading the command line must not load.
    from meshnode.audit.evidence import (
        MAX_EVIDENCE_BYTES,
        EvidenceFault,
        check_evidence,
        decode_evidence,
    )
    from meshnode.audit.evidence_report import evidence_digest

    path: Path = args.file
    try:
        with path.open("rb") as handle:
            # One byte over the limit is enough to refuse it; a larger file is never read whole.
            data = handle.read(MAX_EVIDENCE_BYTES + 1)
    except OSError as error:
        raise CliError(f"cannot read {path}: {error.strerror or error}", EXIT_UNREADABLE) from None
    decoded = decode_evidence(data)
    if isinstance(decoded, AuditEvidence):
        verdict, digest = check_evidence(decoded), evidence_digest(decoded).hex()
    else:
        verdict, digest = decoded, None
    if args.json:
        print(
            json.dumps(
                {
                    "outcome": verdict.outcome.value,
                    "fault": None if verdict.fault is None else verdict.fault.value,
                    "detail": verdict.detail,
                    "accused_id": None if verdict.accused is None else verdict.accused.hex(),
                    "digest": digest,
                    "removal_reason": None if digest is None else f"{EVIDENCE_REASON_PREFIX}{digest}",
                },
                indent=2,
            )
        )
    else:
        print(verdict.line())
        if digest is not None:
            print(f"evidence digest: {digest} (a removal with it says '{EVIDENCE_REASON_PREFIX}{digest}')")
    if verdict.convicted:
        return EXIT_CONVICTED
    return EXIT_UNREADABLE if verdict.fault is EvidenceFault.MALFORMED else EXIT_NOT_EVIDENCE


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "audit", parents=[common], help="audits of what members compute: check evidence"
    )
    actions = parser.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify",
        help="check an evidence file offline",
        description="Check that an evidence file convicts its accused: the accused's own signed "
        "commitment against two other nodes' agreeing ones for the same input. Needs no mesh.",
    )
    verify.add_argument("file", type=Path, metavar="FILE", help="the evidence file (JSON)")
    verify.add_argument("--json", action="store_true", help="print the verdict and digest as JSON")
    verify.set_defaults(handler=run_verify)


__all__ = ["EXIT_CONVICTED", "EXIT_NOT_EVIDENCE", "EXIT_UNREADABLE", "register", "run_verify"]
