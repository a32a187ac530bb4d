"""The TypeScript types the panel and the widget are written against
(``gpushare_ext/widgets/occupancy.d.ts``) say exactly what the broker sends: every
interface matches the msgspec schema of ``protocol.Snapshot`` field for field, type
for type, and every string union matches its enum."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from gpushare_ext.protocol import Snapshot

DTS = Path(__file__).resolve().parents[2] / "gpushare_ext" / "widgets" / "occupancy.d.ts"
SCALARS = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean"}


def declared(text: str) -> tuple[dict[str, dict[str, tuple[str, bool]]], dict[str, set[str]]]:
    """Interfaces (name -> field -> (type, optional)) and string unions in a .d.ts text."""
    interfaces = {}
    for name, body in re.findall(r"export interface (\w+) \{\n(.*?)\n\}", text, re.S):
        fields = {}
        for field, optional, kind in re.findall(r"^\s*(\w+)(\??): ([^;]+);", body, re.M):
            fields[field] = (kind.strip(), optional == "?")
        interfaces[name] = fields
    unions = {
        name: set(re.findall(r'"([^"]+)"', body))
        for name, body in re.findall(r"export type (\w+) =((?:\s*\|\s*\"[^\"]+\")+);", text)
    }
    return interfaces, unions


def typescript(node: dict) -> str:
    """The TypeScript spelling of a JSON-schema node as msgspec writes it."""
    if "$ref" in node:
        return node["$ref"].rsplit("/", 1)[1]
    if "anyOf" in node:
        parts = [typescript(n) for n in node["anyOf"] if n.get("type") != "null"]
        nullable = any(n.get("type") == "null" for n in node["anyOf"])
        return " | ".join(parts + (["null"] if nullable else []))
    kind = node.get("type")
    if kind == "array":
        items = node.get("items") or (node.get("prefixItems") or [{}])[0]
        return f"{typescript(items)}[]"
    if kind == "object":
        return f"Record<string, {typescript(node['additionalProperties'])}>"
    return SCALARS[kind]


def schema_definitions() -> dict[str, dict]:
    return msgspec.json.schema(Snapshot)["$defs"]


def mismatches(text: str) -> list[str]:
    """Where the declared interfaces differ from what the broker sends."""
    interfaces, _ = declared(text)
    found = []
    for name, definition in schema_definitions().items():
        if definition.get("type") != "object":
            continue
        if name not in interfaces:
            found.append(f"{name}: not declared in {DTS.name}")
            continue
        wire = {field: typescript(node) for field, node in definition["properties"].items()}
        ours = {field: kind for field, (kind, _) in interfaces[name].items()}
        if ours != wire:
            found.append(f"{name}: {DTS.name} says {ours}, the broker sends {wire}")
    return found


def test_every_interface_the_broker_sends_matches_its_schema():
    assert mismatches(DTS.read_text()) == []


def test_every_string_union_matches_its_enum():
    _, unions = declared(DTS.read_text())
    enums = {n: set(d["enum"]) for n, d in schema_definitions().items() if "enum" in d}
    assert enums, "the snapshot has enums (lease states)"
    for name, values in enums.items():
        assert unions.get(name) == values, (name, unions.get(name), values)


def test_a_field_out_of_step_is_caught():
    renamed = DTS.read_text().replace("  memory_used_mib: number;", "  memory_use_mib: number;", 1)
    retyped = DTS.read_text().replace("  drained: boolean;", "  drained: number;", 1)
    assert [m.split(":")[0] for m in mismatches(renamed)] == ["DeviceView"]
    assert [m.split(":")[0] for m in mismatches(retyped)] == ["DeviceView"]


JS = DTS.with_suffix("").with_suffix(".js")


def jsdoc_typedefs(text: str) -> dict[str, dict[str, tuple[str, bool]]]:
    """``@typedef {{field: type, ...}} Name`` blocks of a JS file, as in ``declared``."""
    doc = re.sub(r"\n\s*\*\s*", " ", text).replace("=>", "→")  # one line; arrows not brackets
    found = {}
    for body, name in re.findall(r"@typedef \{\{(.*?)\}\} (\w+)", doc):
        fields, depth, part = {}, 0, ""
        for ch in body + ",":
            if ch in "<({[":
                depth += 1
            elif ch in ">)}]":
                depth -= 1
            if ch == "," and depth == 0:
                field, _, kind = part.partition(":")
                fields[field.strip().rstrip("?")] = (kind.strip(), field.strip().endswith("?"))
                part = ""
            else:
                part += ch
        found[name] = fields
    return found


def _spelling(kind: str) -> str:
    return kind.replace(" ", "").replace("=>", "→")


def test_the_widget_s_jsdoc_says_what_the_declarations_say():
    interfaces, _ = declared(DTS.read_text())
    typedefs = jsdoc_typedefs(JS.read_text())
    assert {"Snapshot", "LeaseView", "DeviceView", "DeviceInfo"} <= set(typedefs)
    for name, fields in typedefs.items():
        ours = {f: (_spelling(k), o) for f, (k, o) in interfaces[name].items()}
        theirs = {f: (_spelling(k), o) for f, (k, o) in fields.items()}
        assert theirs == ours, (name, theirs, ours)
