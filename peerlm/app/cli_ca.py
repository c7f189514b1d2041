"""``peerlm ca``: create a federation CA, issue role-bearing certificates, inspect them.

Every failure a person can cause (existing files, unknown role, bad name, missing CA) exits
with status 2 and one readable line on stderr, never a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from peerlm.pki.ca import (
    KEY_TYPES,
    CertificateInfo,
    KeyType,
    init_ca,
    inspect_certificate,
    issue_certificate,
)
from peerlm.pki.identity import Role

__all__ = ["app"]

app = typer.Typer(
    help="Federation PKI: a CA per federation and one certificate per CPM, agent or overlay node.",
    no_args_is_help=True,
    add_completion=False,
)

_USAGE_ERROR = 2


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=_USAGE_ERROR)


def _key_type(value: str) -> KeyType:
    if value == "ec-p256":
        return "ec-p256"
    if value == "ed25519":
        return "ed25519"
    _fail(f"unknown key type {value!r}: expected one of {', '.join(KEY_TYPES)}")


def _role(value: str) -> Role:
    try:
        return Role(value.lower())
    except ValueError:
        _fail(f"unknown role {value!r}: expected one of {', '.join(r.value for r in Role)}")


@app.command("init")
def init_command(
    directory: Annotated[
        Path, typer.Option("--dir", help="Directory for ca.crt and ca.key (created if missing).")
    ],
    federation: Annotated[
        str, typer.Option(help="Federation (SPIFFE trust domain) name.")
    ] = "peerlm",
    key_type: Annotated[
        str, typer.Option("--key-type", help="ec-p256 (default) or ed25519.")
    ] = "ec-p256",
    days: Annotated[int, typer.Option(help="CA lifetime in days.")] = 3650,
) -> None:
    """Create a federation CA (refuses to overwrite an existing one)."""
    try:
        files = init_ca(directory, federation=federation, key_type=_key_type(key_type), days=days)
    except (OSError, ValueError) as err:
        _fail(str(err))
    typer.echo(f"created CA for federation {files.federation!r}: {files.cert} (key {files.key})")


@app.command("issue")
def issue_command(
    directory: Annotated[Path, typer.Option("--dir", help="CA directory (holds ca.crt/ca.key).")],
    role: Annotated[str, typer.Option(help="cpm, agent, overlay or admin.")],
    name: Annotated[
        str,
        typer.Option(
            help="Peer name; also the file name <name>.crt/.key (agent and overlay members "
            "also get <name>.vrf.key, their overlay identity key)."
        ),
    ],
    san: Annotated[
        list[str] | None,
        typer.Option(help="Host name or IP address peers dial this process by (repeatable)."),
    ] = None,
    days: Annotated[int, typer.Option(help="Certificate lifetime in days.")] = 365,
) -> None:
    """Issue a certificate and key for one federation member, signed by the CA in --dir."""
    parsed_role = _role(role)
    try:
        issued = issue_certificate(directory, parsed_role, name, sans=san or (), days=days)
    except (OSError, ValueError) as err:
        _fail(str(err))
    typer.echo(f"issued {issued.identity.spiffe_uri}: {issued.cert} (key {issued.key})")
    if issued.vrf_key is not None and issued.identity.vrf_public_key is not None:
        typer.echo(
            f"overlay identity (VRF) key {issued.vrf_key}, "
            f"public key {issued.identity.vrf_public_key.hex()}"
        )


def _render(info: CertificateInfo, console: Console) -> None:
    table = Table(title=str(info.path), show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("subject", info.subject)
    table.add_row("issuer", info.issuer)
    table.add_row("identity", info.identity.spiffe_uri if info.identity else "(none)")
    table.add_row("SANs", "\n".join(info.sans) or "(none)")
    table.add_row("CA", "yes" if info.is_ca else "no")
    table.add_row("key type", info.key_type)
    if info.vrf_public_key is not None:
        table.add_row("VRF public key", info.vrf_public_key.hex())
    table.add_row("not before", info.not_valid_before.isoformat())
    expiry = info.not_valid_after.isoformat()
    table.add_row("not after", f"[red]{expiry} (EXPIRED)[/red]" if info.expired else expiry)
    table.add_row("serial", f"{info.serial:x}")
    table.add_row("sha256", info.sha256_fingerprint)
    console.print(table)


@app.command("inspect")
def inspect_command(
    file: Annotated[Path, typer.Argument(help="A PEM certificate file.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON object.")] = False,
) -> None:
    """Show a certificate's subject, SANs, federation identity, VRF public key and expiry."""
    try:
        info = inspect_certificate(file)
    except (OSError, ValueError) as err:
        _fail(str(err))
    if as_json:
        typer.echo(json.dumps(info.to_json_dict(), indent=2))
    else:
        _render(info, Console())
