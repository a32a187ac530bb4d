"""The files in deploy/ are valid for the tools that read them, and agree with each other.

* the example policy parses with the broker's own parser (so every key is one it accepts);
* the IPython snippet really loads the extension in a real IPython;
* the jupyter_server snippet really enables the server extension;
* the JupyterHub snippet pins kernels to the system broker;
* the systemd unit passes ``systemd-analyze verify``;
* the Kubernetes objects pass ``kubernetes-validate --strict`` (offline schemas), and the
  DaemonSet, the z2jh values and the runtime agree on where the socket is;
* the hub test can follow docs/deploy.md's walkthrough as written: its blocks are found
  in order, each text the test replaces is there, and what it runs touches none of the
  host's own deployment paths (tests/hub runs it, as root).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from traitlets.config.loader import PyFileConfigLoader

from gpushare_ext.broker.settings.config import load_config, parse_config
from gpushare_ext.paths import SYSTEM_RUNTIME_DIR, SYSTEM_SOCKET
from gpushare_ext.protocol import priority_value

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
GIB = 1024**3


def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_object(kind: str, name: str | None = None) -> dict:
    for doc in load_yaml_documents(K8S / "gpushare-broker.yaml"):
        if doc["kind"] == kind and (name is None or doc["metadata"]["name"] == name):
            return doc
    raise AssertionError(f"no {kind} {name or ''} in gpushare-broker.yaml")


# ------------------------------------------------------------------ policy


def test_the_example_policy_is_accepted_by_the_broker():
    config = parse_config((DEPLOY / "broker.toml").read_text(), "deploy/broker.toml")
    policy = config.policy
    assert policy.admin_groups == ("gpuadmin",)
    assert config.metrics_port == 9400

    student = policy.limits_for("alice", ("users", "students"))
    assert student.max_priority == priority_value("normal")
    assert student.memory_quota == 16 * GIB
    assert student.aging_per_minute == 20
    assert student.slice.value == "shared"

    staff = policy.limits_for("bob", ("teachers",))
    assert staff.max_priority == priority_value("high")
    assert staff.memory_quota == 80 * GIB

    nobody = policy.limits_for("carol", ())
    assert nobody.memory_quota == 40 * GIB and nobody.default_memory == 8 * GIB


def test_the_kubernetes_policy_is_the_same_policy_as_the_example():
    in_cluster = parse_config(
        k8s_object("ConfigMap", "gpushare-broker-config")["data"]["broker.toml"], "ConfigMap"
    )
    example = parse_config((DEPLOY / "broker.toml").read_text())
    for groups in ((), ("students",), ("teachers",)):
        assert in_cluster.policy.limits_for("x", groups) == example.policy.limits_for("x", groups)


def toml_blocks(markdown: Path) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", markdown.read_text(), re.DOTALL)


def test_every_policy_example_in_the_docs_parses():
    blocks = toml_blocks(REPO / "docs" / "policy.md")
    assert blocks, "docs/policy.md should show the policy file"
    for block in blocks:
        parse_config(block, "a docs/policy.md example")


def test_the_docs_show_the_example_policy_file_whole():
    example = (DEPLOY / "broker.toml").read_text().strip()
    assert example in [block.strip() for block in toml_blocks(REPO / "docs" / "policy.md")]


# ------------------------------------------------------------------ Jupyter snippets


def test_the_ipython_snippet_loads_the_extension_in_a_real_ipython(tmp_path):
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    shutil.copy(DEPLOY / "ipython_config.py", profile / "ipython_config.py")
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython"), "HOME": str(tmp_path)}
    code = (
        "ip = get_ipython(); "
        "print('LOADED', 'gpushare_ext' in ip.extension_manager.loaded, "
        "'gpu' in ip.magics_manager.magics['cell'])"
    )
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--no-banner", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "LOADED True True" in done.stdout, done.stdout + done.stderr


def test_the_ipython_snippet_keeps_extensions_from_other_config_files(tmp_path):
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    text = (DEPLOY / "ipython_config.py").read_text()
    (profile / "ipython_config.py").write_text(
        "c = get_config()\nc.InteractiveShellApp.extensions = ['autoreload']\n" + text
    )
    env = {**os.environ, "IPYTHONDIR": str(tmp_path / "ipython"), "HOME": str(tmp_path)}
    code = "print('LOADED', sorted(get_ipython().extension_manager.loaded))"
    done = subprocess.run(
        [sys.executable, "-m", "IPython", "--no-banner", "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert "autoreload'" in done.stdout and "'gpushare_ext'" in done.stdout, done.stdout


def test_the_server_snippet_enables_the_server_extension(tmp_path):
    shutil.copy(DEPLOY / "jupyter_server_config.py", tmp_path / "jupyter_server_config.py")
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path), "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_server", "extension", "list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    listing = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert re.search(r"gpushare_ext enabled", listing), listing
    assert re.search(r"gpushare_ext \S+ OK", listing), listing


def test_the_hub_snippet_runs_servers_from_the_hub_environment_pinned_to_the_system_broker():
    config = PyFileConfigLoader("jupyterhub_config.py", path=str(DEPLOY)).load_config()
    assert config.Spawner.cmd == [os.path.join(sys.prefix, "bin", "jupyterhub-singleuser")]
    environment = config.Spawner.environment.get_value({})
    assert environment["GPUSHARE_SOCKET"] == str(SYSTEM_SOCKET)
    # Users' servers find this environment's commands first (`!gpushare status`).
    assert environment["PATH"].split(os.pathsep)[0] == os.path.join(sys.prefix, "bin")


def test_the_installed_package_carries_the_deploy_files_and_the_guides():
    """What the hub's load_subconfig and the unit's Documentation= point at is installed
    (the hub test loads the installed copy; this checks the mapping and the unit)."""
    import tomllib

    build = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    shared = build["targets"]["wheel"]["shared-data"]
    assert shared["deploy"] == "share/gpushare/deploy"
    assert shared["docs"] == "share/doc/gpushare"
    unit = (DEPLOY / "gpushare-broker.service").read_text()
    assert "Documentation=file:///opt/gpushare/share/doc/gpushare/deploy.md" in unit
    assert (REPO / "docs" / "deploy.md").exists()
    guide = (REPO / "docs" / "deploy.md").read_text()
    assert 'load_subconfig("/opt/gpushare/share/gpushare/deploy/jupyterhub_config.py")' in guide


# ------------------------------------------------------------------ systemd


def test_the_systemd_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed: cannot verify the unit file")
    unit = (DEPLOY / "gpushare-broker.service").read_text()
    assert "ExecStart=/opt/gpushare/bin/gpushare broker --system" in unit
    # verify checks that ExecStart's program exists: point it at this environment's.
    here = Path(sys.prefix) / "bin" / "gpushare"
    if not here.exists():
        pytest.skip(f"{here} is missing: install the package to verify the unit")
    (tmp_path / "gpushare-broker.service").write_text(
        unit.replace("/opt/gpushare/bin/gpushare", str(here))
    )
    done = subprocess.run(
        [analyze, "verify", str(tmp_path / "gpushare-broker.service")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    problems = [
        line
        for line in (done.stdout + done.stderr).splitlines()
        if "gpushare-broker.service" in line
    ]
    assert done.returncode == 0 and not problems, done.stdout + done.stderr


# ------------------------------------------------------------------ Kubernetes


def test_every_kubernetes_object_passes_strict_schema_validation():
    validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (offline k8s schemas)"
    )
    version = validate.latest_version()
    documents = load_yaml_documents(K8S / "gpushare-broker.yaml")
    assert {doc["kind"] for doc in documents} >= {"DaemonSet", "ConfigMap", "Service"}
    for document in documents:
        validate.validate(document, version, strict=True)


def test_the_daemonset_shares_the_socket_dir_and_may_pause_other_pods():
    daemonset = k8s_object("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    broker = next(c for c in pod["containers"] if c["name"] == "broker")
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["hostPID"] is True  # peer pids and cuCheckpointProcessLock(pid)
    assert broker["securityContext"]["privileged"] is True
    assert "nvidia.com/gpu" not in json.dumps(broker.get("resources", {}))
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in broker["volumeMounts"]}
    assert volumes[mounts[str(SYSTEM_RUNTIME_DIR)]]["hostPath"]["path"] == str(SYSTEM_RUNTIME_DIR)
    assert volumes[mounts["/var/lib/gpushare"]]["hostPath"]["path"] == "/var/lib/gpushare"
    assert broker["command"][:3] == ["gpushare", "broker", "--system"]


def test_the_init_container_writes_a_config_naming_the_node(tmp_path):
    pod = k8s_object("DaemonSet")["spec"]["template"]["spec"]
    init = pod["initContainers"][0]
    (tmp_path / "config").mkdir()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc").chmod(0o777)  # what an emptyDir volume is made with
    template = k8s_object("ConfigMap", "gpushare-broker-config")["data"]["broker.toml"]
    (tmp_path / "config" / "broker.toml").write_text(template)
    script = init["command"][2].replace("/config/", f"{tmp_path}/config/")
    script = script.replace("/etc/gpushare", f"{tmp_path}/etc")
    assert "/etc/gpushare" not in script  # the test touches no directory of the host
    subprocess.run(["sh", "-c", script], env={**os.environ, "NODE_NAME": "gpu-node-7"}, check=True)
    # The broker's own read: the directory and file it gets must be ones it trusts.
    config = load_config(tmp_path / "etc" / "broker.toml")
    assert config.node_name == "gpu-node-7"


def test_the_metrics_service_and_monitor_reach_the_metrics_sidecar():
    pod = k8s_object("DaemonSet")["spec"]["template"]["spec"]
    ports = {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
    service = k8s_object("Service")
    monitor = load_yaml_documents(K8S / "servicemonitor.yaml")[0]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["kind"] == "ServiceMonitor"
    assert service["spec"]["ports"][0]["targetPort"] in ports
    labels = k8s_object("DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }


# The part of the z2jh chart's values this deployment relies on (chart 3.x/4.x names).
Z2JH_SUBSET_SCHEMA = {
    "type": "object",
    "required": ["hub", "singleuser"],
    "properties": {
        "hub": {
            "type": "object",
            "properties": {
                "extraConfig": {"type": "object", "additionalProperties": {"type": "string"}}
            },
        },
        "singleuser": {
            "type": "object",
            "required": ["image", "extraEnv", "storage", "extraPodConfig"],
            "properties": {
                "image": {
                    "type": "object",
                    "required": ["name", "tag"],
                    "properties": {"name": {"type": "string"}, "tag": {"type": "string"}},
                },
                "defaultUrl": {"type": "string"},
                "extraPodConfig": {"type": "object"},
                "extraResource": {
                    "type": "object",
                    "properties": {
                        "limits": {"type": "object", "additionalProperties": {"type": "string"}},
                        "guarantees": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        },
                    },
                    "additionalProperties": False,
                },
                "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"}},
                "extraTolerations": {"type": "array", "items": {"type": "object"}},
                "extraEnv": {"type": "object"},
                "storage": {
                    "type": "object",
                    "properties": {
                        "extraVolumes": {"type": "array", "items": {"type": "object"}},
                        "extraVolumeMounts": {"type": "array", "items": {"type": "object"}},
                    },
                },
                "fsGid": {"type": ["integer", "null"]},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}


def test_the_z2jh_values_mount_the_brokers_socket_dir_into_every_notebook_pod():
    import jsonschema

    values = yaml.safe_load((K8S / "z2jh-values.yaml").read_text())
    jsonschema.validate(values, Z2JH_SUBSET_SCHEMA)
    single = values["singleuser"]
    volume = next(v for v in single["storage"]["extraVolumes"] if "hostPath" in v)
    mount = next(m for m in single["storage"]["extraVolumeMounts"] if m["name"] == volume["name"])
    assert volume["hostPath"]["path"] == str(SYSTEM_RUNTIME_DIR)
    assert mount["mountPath"] == str(SYSTEM_RUNTIME_DIR)
    assert single["extraEnv"]["GPUSHARE_SOCKET"] == str(SYSTEM_SOCKET)
    assert single["extraPodConfig"]["runtimeClassName"] == "nvidia"
    assert single["extraResource"]["limits"]["nvidia.com/gpu"] == "1"
    # the hub's per-user uids are valid Python that defines the spawner hooks
    namespace: dict = {"c": _Recorder()}
    exec(values["hub"]["extraConfig"]["gpushare-identities"], namespace)
    assert callable(namespace["gpushare_uid"])


class _Recorder:
    """A stand-in for traitlets' ``c``: any attribute path may be assigned."""

    def __getattr__(self, name: str) -> _Recorder:
        value = _Recorder()
        object.__setattr__(self, name, value)
        return value


# ------------------------------------------------------------------ the walkthrough


def hub_module(name: str) -> ModuleType:
    """A module of tests/hub (not on the path unless that folder was collected first)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "hub" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


deploy_doc = hub_module("deploy_doc")  # first: local_install imports it
local_install = hub_module("local_install")
GUIDE = deploy_doc.DEPLOY_GUIDE.read_text()


def choices(tmp_path: Path) -> local_install.Choices:
    return local_install.Choices(
        workdir=tmp_path, port=18000, hub_port=18081, proxy_api_port=18001, password="pw-test"
    )


def test_the_walkthrough_has_its_nine_steps_and_their_blocks_in_page_order():
    walkthrough = deploy_doc.read_walkthrough()
    assert walkthrough.steps == list(range(1, 10))
    steps = [block.step for block in walkthrough.blocks]
    assert steps == sorted(steps), "blocks must be read in page order"
    assert set(steps) == set(range(10)), "the variables and every step have a block"
    assert walkthrough.titles[1] == "A virtual environment everyone can run"
    assert walkthrough.titles[9] == "The hub"
    first = walkthrough.blocks[0]
    assert first.step == 0 and first.lines[0].startswith("REPO=$PWD")
    # Step 9: the config is written before the token's file is made and the hub started.
    kinds = [block.language for block in walkthrough.blocks_of(9)]
    assert kinds == ["python", "bash", "bash"]


def test_the_hub_test_follows_every_step_with_only_its_paths_and_ports(tmp_path):
    ours = choices(tmp_path)
    prepared = local_install.prepare(ours)  # DocDrift if a replaced text is missing
    text = "\n".join(block.text for block in prepared.blocks)
    original = "\n".join(block.text for block in deploy_doc.read_walkthrough().blocks)
    assert f"PREFIX={local_install.PREFIX} " in text
    assert f'load_subconfig("{local_install.PREFIX}/share/gpushare/deploy/' in text
    assert f'"http://127.0.0.1:{ours.port}"' in text
    assert f'open("{ours.token_file}").read().strip()' in text
    assert "'pw-test'" in text
    assert not local_install.HOST_PLACES.search(text)
    assert prepared.check_as_any_user.text == f"{local_install.PREFIX}/bin/gpushare status"
    # Nothing but the substitutions changed: undoing them gives the page's blocks back.
    for substitution in local_install.substitutions(ours):
        text = text.replace(substitution.ours, substitution.written)
    walkthrough = deploy_doc.read_walkthrough()
    fixed_token = walkthrough.inline_command(*local_install.FIXED_TOKEN_SETTING).text
    text = text.replace(fixed_token, local_install.TOKEN_SETTING_WRITTEN)
    assert text == original


def test_the_long_running_commands_are_started_as_written(tmp_path):
    install = local_install.LocalInstall(local_install.prepare(choices(tmp_path)))
    broker = install.background_script(8).splitlines()
    assert broker[-1] == (
        "exec $PREFIX/bin/gpushare broker --system --config $CONFIG --journal $JOURNAL "
        "--simulate h200"
    )
    hub = install.background_script(9).splitlines()
    assert hub[-2:] == [
        f"install -d -m 0700 {tmp_path}/hub && cd {tmp_path}/hub",
        "exec $PREFIX/bin/jupyterhub -f $HUB_CONFIG",
    ]


def test_the_variables_block_sets_the_test_s_own_values(tmp_path):
    install = local_install.LocalInstall(local_install.prepare(choices(tmp_path)))
    install.check_variables()  # StepFailed otherwise


def test_step_5_adds_each_missing_user_to_their_group(tmp_path):
    install = local_install.LocalInstall(local_install.prepare(choices(tmp_path)))
    block = install.prepared.block(5)
    script = local_install.users_script(block, {"u-one": "students", "u-two": "teachers"})
    # The commands stand in for themselves: what they would be called with.
    stand_ins = 'groupadd() { echo "groupadd $*"; }\nuseradd() { echo "useradd $*"; }\n'
    done = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + stand_ins + script],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines() == [
        "groupadd -f students",
        "groupadd -f teachers",
        "groupadd -f gpuadmin",
        "useradd -m -G students u-one",
        "useradd -m -G teachers u-two",
    ]


def blocks_text_of(step: int) -> list[str]:
    """The texts the page writes for ``step``: its blocks and the inline commands used."""
    walkthrough = deploy_doc.read_walkthrough()
    texts = [block.text for block in walkthrough.blocks_of(step)]
    for inline_step, lead_in in (
        local_install.CHECK_AS_ANY_USER,
        local_install.FIXED_TOKEN_SETTING,
    ):
        if inline_step == step:
            texts.append(walkthrough.inline_command(inline_step, lead_in).text)
    return texts


def without_in_step(step: int, written: str) -> str:
    """The page with ``written`` gone from ``step``'s code only."""
    page = GUIDE
    for text in blocks_text_of(step):
        page = page.replace(text, text.replace(written, "<changed>"))
    return page


@pytest.mark.parametrize(
    "substitution",
    [
        *local_install.substitutions(local_install.Choices(Path("/w"), 1, 2, 3, "p")),
        deploy_doc.Substitution(9, local_install.TOKEN_SETTING_WRITTEN, ""),
    ],
    ids=lambda s: f"step{s.step}:{s.written}",
)
def test_a_replaced_text_the_page_no_longer_writes_fails_naming_its_step(tmp_path, substitution):
    page = without_in_step(substitution.step, substitution.written)
    with pytest.raises(deploy_doc.DocDrift) as failure:
        local_install.prepare(choices(tmp_path), page)
    message = str(failure.value)
    assert f"step {substitution.step} (" in message
    assert repr(substitution.written) in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("old", "new", "said"),
    [
        ("**4. JupyterHub's proxy**", "**The proxy**", "steps [1, 2, 3, 5, 6"),
        ("```bash\nchmod -R", "```sh\nchmod -R", "step 3 has a ```sh block"),
        ("Check it as any user: ", "Check it: ", "step 8 no longer has an inline"),
        (
            "$PREFIX/bin/jupyterhub -f $HUB_CONFIG\n",
            "jupyterhub -f $HUB_CONFIG\n",
            "step 9's last block no longer ends with '$PREFIX/bin/jupyterhub '",
        ),
        ("$CONFIG\n```", "/etc/gpushare/broker.toml\n```", "step 7 (The policy) writes /etc/gpushare"),
    ],
    ids=["a step unnumbered", "a block in another language", "the check's words",
         "the hub started otherwise", "a host path not replaced"],
)  # fmt: skip
def test_a_page_the_hub_test_cannot_follow_fails_in_one_line(tmp_path, old, new, said):
    section = deploy_doc.section_text(GUIDE)
    assert old in section, f"the page no longer writes {old!r}"
    page = GUIDE.replace(section, section.replace(old, new, 1))
    with pytest.raises(deploy_doc.DocDrift) as failure:
        local_install.prepare(choices(tmp_path), page)
    assert said in str(failure.value)
    assert "\n" not in str(failure.value)


def test_a_page_without_the_walkthrough_fails_in_one_line(tmp_path):
    page = GUIDE.replace(deploy_doc.SECTION_HEADING, "## 1. On one host")
    with pytest.raises(
        deploy_doc.DocDrift, match=r"^docs/deploy\.md has no section '## 1\. On one"
    ):
        local_install.prepare(choices(tmp_path), page)
