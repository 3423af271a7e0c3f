"""``meshnode remove``, ``meshnode admin grant``, ``meshnode policy``, and ``invite --list`` / ``--revoke``:
an admin's commands.

Each signs on the command line with the mesh key in the data directory (only an
admin has one, so a plain member is told so and nothing is signed), then hands
the result to the node running on it through its control socket, which spreads
it (:mod:`meshnode.node.membership_keeper`). A revocation made while the node is
down is kept in the data directory; the node spreads it when it starts.
"""

from __future__ import annotations

import argparse
import base64
import time
from pathlib import Path
from typing import Any

from meshnode.app.status import query_node_status
from meshnode.commandline.cli_error import CliError
from meshnode.commandline.data_dirs import node_data_dir
from meshnode.gen.meshnode.v1 import membership_pb2 as membership
from meshnode.gen.meshnode.v1.audit_pb2 import AuditEvidence
from meshnode.identity import IdentityError, load_identity, short_id
from meshnode.membership.credentials import MeshKey
from meshnode.membership.invite_ledger import invite_state, load_ledger
from meshnode.membership.mesh_policy import sign_policy
from meshnode.membership.revocation import MAX_REASON_CHARS, RevocationList, revoke_invite, revoke_node
from meshnode.membership.store import DataDir, MembershipState, StoreError
from meshnode.statussocket.client import ask_node
from meshnode.wire.mesh_refusal import MeshRefusal

# How a removal's reason cites the evidence it was decided on (its digest follows, 64 hex digits).
EVIDENCE_REASON_PREFIX = "audit evidence "

NOT_ADMIN = (
    "this node is not an admin of its mesh: only admins hold the mesh key, so nothing it signed "
    "would be accepted (an admin can promote it with `meshnode admin grant NODE`)"
)


def _membership(args: argparse.Namespace) -> tuple[bytes, DataDir, MembershipState]:
    path = node_data_dir(args)
    try:
        identity = load_identity(path)
        data_dir = DataDir(path)
        return identity.node_id, data_dir, data_dir.load_membership(identity.node_id)
    except (IdentityError, StoreError, MeshRefusal) as exc:
        raise CliError(str(exc)) from None


def _admin_key(membership_state: MembershipState) -> MeshKey:
    if membership_state.mesh_key is None:
        raise CliError(NOT_ADMIN)
    return membership_state.mesh_key


def _running_status(args: argparse.Namespace) -> dict[str, Any] | None:
    try:
        return query_node_status(node_data_dir(args))
    except OSError:
        return None


def resolve_id(text: str, candidates: list[bytes], what: str) -> bytes:
    """A full hex id, or a unique prefix of a candidate's hex or short id."""
    text = text.strip().lower()
    if len(text) == 64:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    matches = {c for c in candidates if c.hex().startswith(text) or short_id(c).startswith(text)}
    if len(matches) == 1:
        return matches.pop()
    if not matches:
        raise CliError(f"no {what} matches {text!r} (give its full 64-hex id)", code=2)
    raise CliError(f"{text!r} matches {len(matches)} {what}s; give more of its id", code=2)


def _publish(args: argparse.Namespace, data_dir: DataDir, revocation: membership.Revocation) -> str:
    """Hand ``revocation`` to the running node, or keep it for the node's next start."""
    line = "revoke " + base64.b64encode(revocation.SerializeToString()).decode("ascii")
    try:
        answer = ask_node(data_dir.path, line)
    except OSError:
        stored = data_dir.load_revocations()
        data_dir.save_revocations([*stored, revocation])
        return "the node is not running: it spreads the revocation when it starts"
    if "error" in answer:
        raise CliError(f"the node refused the revocation: {answer['error']}")
    return "the node is spreading it to every peer and relay"


def _reason(args: argparse.Namespace) -> str:
    if len(args.reason) > MAX_REASON_CHARS:
        raise CliError(f"--reason is at most {MAX_REASON_CHARS} characters", code=2)
    return str(args.reason)


def _evidence_reason(path: Path, reason: str) -> tuple[bytes, str]:
    """The node an evidence file convicts, and the removal's reason citing the evidence's digest
    (``meshnode audit verify`` checks the same file; status shows the digest of evidence held)."""
    # Imported here: the digests need numpy, which reading the command line must not load.
    from meshnode.audit.evidence import MAX_EVIDENCE_BYTES, decode_evidence, verify_evidence_bytes
    from meshnode.audit.evidence_report import evidence_digest

    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_EVIDENCE_BYTES + 1)
    except OSError as error:
        raise CliError(f"cannot read {path}: {error.strerror or error}", code=2) from None
    verdict = verify_evidence_bytes(data)
    evidence = decode_evidence(data)
    if not verdict.convicted or verdict.accused is None or not isinstance(evidence, AuditEvidence):
        raise CliError(f"{path} is not evidence that convicts: {verdict.line()}", code=2)
    print(verdict.line())
    cited = f"{EVIDENCE_REASON_PREFIX}{evidence_digest(evidence).hex()}"
    full = f"{cited}: {reason}" if reason else cited
    if len(full) > MAX_REASON_CHARS:
        room = MAX_REASON_CHARS - len(cited) - 2
        raise CliError(f"with --evidence, --reason is at most {room} characters", code=2)
    return verdict.accused, full


def cmd_remove(args: argparse.Namespace) -> int:
    node_id, data_dir, ours = _membership(args)
    mesh_key = _admin_key(ours)
    reason = _reason(args)
    accused: bytes | None = None
    if args.evidence is not None:
        accused, reason = _evidence_reason(args.evidence, reason)
    elif args.node is None:
        raise CliError("name the member to remove, or give --evidence FILE", code=2)
    if args.node is None:
        assert accused is not None
        target = accused
    else:
        status = _running_status(args)
        candidates: list[bytes] = [] if accused is None else [accused]
        if status is not None:
            candidates += [bytes.fromhex(p["id"]) for p in status["peers"]]
            candidates += [bytes.fromhex(m["id"]) for m in status.get("membership", {}).get("members", [])]
        target = resolve_id(args.node, [c for c in set(candidates) if c != node_id], "member")
    if accused is not None and target != accused:
        raise CliError(
            f"the evidence convicts {short_id(accused)}, not {short_id(target)}: remove the node it names",
            code=2,
        )
    if target == node_id:
        raise CliError("an admin cannot remove itself (another admin can)", code=2)
    revocation = revoke_node(mesh_key, node_id=target, reason=reason, issuer_id=node_id, unix_now=time.time())
    how = _publish(args, data_dir, revocation)
    print(f"removed node {short_id(target)} ({target.hex()}) from mesh {ours.mesh_id}; {how}")
    return 0


def cmd_admin_grant(args: argparse.Namespace) -> int:
    _node_id, data_dir, ours = _membership(args)
    _admin_key(ours)
    status = _running_status(args)
    if status is None:
        raise CliError("the node is not running: it hands the mesh key over on the member's next gossip")
    candidates = [bytes.fromhex(p["id"]) for p in status["peers"]]
    target = resolve_id(args.node, candidates, "peer")
    answer = ask_node(data_dir.path, f"grant-admin {target.hex()}")
    if "error" in answer:
        raise CliError(str(answer["error"]))
    print(
        f"node {short_id(target)} becomes an admin on its next gossip with this node "
        "(it receives the mesh key and an admin certificate)"
    )
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    """Sign the mesh policy: the one in force changed as the options say (each option unsaid keeps
    its value), issued after it so that it stands everywhere."""
    node_id, data_dir, ours = _membership(args)
    mesh_key = _admin_key(ours)
    status = _running_status(args)
    if status is None:
        raise CliError("the node is not running: start it, then set the policy (it spreads it at once)")
    evidence = status.get("evidence") or {}
    current = evidence.get("policy") or {}
    quarantine = bool(current.get("quarantine_on_evidence", False))
    if args.quarantine_on_evidence is not None:
        quarantine = args.quarantine_on_evidence == "on"
    require_handoffs = bool(current.get("require_handoffs", False))
    if args.require_handoffs is not None:
        require_handoffs = args.require_handoffs == "on"
    cleared = {bytes.fromhex(n) for n in current.get("cleared", [])}
    known = [bytes.fromhex(h["accused_id"]) for h in evidence.get("held", [])]
    known += [bytes.fromhex(p["id"]) for p in status["peers"]]
    cleared |= {resolve_id(text, known, "accused node") for text in args.clear}
    cleared -= {resolve_id(text, list(cleared), "cleared node") for text in args.unclear}
    issued = max(time.time(), float(current.get("issued_unix", 0)) + 1)
    try:
        policy = sign_policy(
            mesh_key,
            issuer_id=node_id,
            unix_now=issued,
            quarantine_on_evidence=quarantine,
            cleared=cleared,
            require_handoffs=require_handoffs,
        )
    except ValueError as exc:
        raise CliError(str(exc), code=2) from None
    answer = ask_node(data_dir.path, "policy " + base64.b64encode(policy.SerializeToString()).decode("ascii"))
    if "error" in answer:
        raise CliError(f"the node refused the policy: {answer['error']}")
    names = ", ".join(short_id(n) for n in sorted(cleared)) or "none"
    print(
        f"mesh policy: {'quarantine' if quarantine else 'no quarantine'} on audit evidence; cleared: {names}; "
        f"handoffs {'required' if require_handoffs else 'not required'}; the node is spreading it to every peer"
    )
    return 0


def list_invites(args: argparse.Namespace) -> int:
    _node_id, data_dir, ours = _membership(args)
    revocations = RevocationList(ours.mesh_id)
    revocations.learn(data_dir.load_revocations())
    entries = load_ledger(data_dir.path)
    now = time.time()
    print(f"invites issued by this node ({len(entries)}):")
    for entry in entries:
        state = invite_state(entry, revocations, unix_now=now)
        expires = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry.expires_unix))
        used = ", ".join(short_id(n) for n in entry.used_by)
        used_text = f"  used by {used}" if used else ""
        print(f"  {short_id(entry.invite_id)}  {state:8}  expires {expires}{used_text}")
    return 0


def revoke_invite_command(args: argparse.Namespace) -> int:
    node_id, data_dir, ours = _membership(args)
    mesh_key = _admin_key(ours)
    entries = load_ledger(data_dir.path)
    invite_id = resolve_id(args.revoke, [e.invite_id for e in entries], "invite")
    entry = next((e for e in entries if e.invite_id == invite_id), None)
    revocation = revoke_invite(
        mesh_key, invite_id=invite_id, reason=_reason(args), issuer_id=node_id, unix_now=time.time()
    )
    how = _publish(args, data_dir, revocation)
    print(f"withdrew invite {short_id(invite_id)}; {how}")
    if entry is not None and entry.used_by:
        print(
            "it was already used by " + ", ".join(short_id(n) for n in entry.used_by) + ": they stay "
            "members unless you `meshnode remove` them"
        )
    return 0


def add_invite_options(parser: argparse.ArgumentParser) -> None:
    """``meshnode invite``'s --list, --revoke and --reason (the command itself is node_commands')."""
    parser.add_argument(
        "--list", action="store_true", help="list the invites this node issued and their state"
    )
    parser.add_argument("--revoke", metavar="ID", help="withdraw an invite (its id from --list)")
    parser.add_argument("--reason", default="", help="with --revoke: why, shown to whoever tries it")


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Hook for ``meshnode.app.cli.COMMAND_MODULES``."""
    p = subparsers.add_parser(
        "remove",
        parents=[common],
        help="remove a member from the mesh (admins)",
        description="Sign a revocation of NODE with the mesh key: every node refuses its links, "
        "certificate, gossip and sessions, every relay its registration, and it exits saying why. "
        "Permanent: the machine needs a new identity and invite to come back.",
    )
    p.add_argument(
        "node",
        metavar="NODE",
        nargs="?",
        help="the member's id (hex or short id, or a unique prefix); with --evidence, the node it convicts",
    )
    p.add_argument("--reason", default="", help="why; shown to the removed node and in status")
    p.add_argument(
        "--evidence",
        type=Path,
        metavar="FILE",
        help="audit evidence that convicts the member (what `meshnode audit verify` checks, e.g. from "
        "`meshnode status --json`): checked first, and its digest is the removal's reason",
    )
    p.set_defaults(handler=cmd_remove)

    p = subparsers.add_parser(
        "policy",
        parents=[common],
        help="what nodes do on audit evidence against a member (admins)",
        description="Sign the mesh policy with the mesh key; the running node spreads it to every peer. "
        "With --quarantine-on-evidence on, a node that verified audit evidence against a member "
        "quarantines it: no route goes through it and placement ignores its claims and the layers it "
        "serves, until an admin clears it (--clear) or removes it. Options left out keep their value.",
    )
    p.add_argument("--quarantine-on-evidence", choices=("on", "off"), help="quarantine on valid evidence")
    p.add_argument(
        "--require-handoffs",
        choices=("on", "off"),
        help="on: every hop refuses float32 hidden states that come without the sender's signed handoff "
        "and heads route only through nodes that announce they sign them (older nodes are left out); "
        "off (the default): a node that sends none is taken as an older node",
    )
    p.add_argument(
        "--clear",
        action="append",
        default=[],
        metavar="NODE",
        help="clear an accused node: evidence against it changes nothing (repeatable)",
    )
    p.add_argument(
        "--unclear", action="append", default=[], metavar="NODE", help="undo a --clear (repeatable)"
    )
    p.set_defaults(handler=cmd_policy)

    p = subparsers.add_parser(
        "admin",
        parents=[common],
        help="make another member an admin (admins)",
        description="`meshnode admin grant NODE`: hand NODE the mesh key and an admin certificate on "
        "its next gossip with this node. An admin can invite, renew, remove and grant.",
    )
    actions = p.add_subparsers(dest="admin_action", required=True, metavar="ACTION")
    grant = actions.add_parser("grant", parents=[common], help="make NODE an admin")
    grant.add_argument("node", metavar="NODE", help="the member's id (hex or short id, or a unique prefix)")
    grant.set_defaults(handler=cmd_admin_grant)


__all__ = [
    "NOT_ADMIN",
    "add_invite_options",
    "list_invites",
    "register",
    "resolve_id",
    "revoke_invite_command",
]
