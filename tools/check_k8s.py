#!/usr/bin/env python3
"""Offline check of the rendered Kubernetes manifests (deploy/k8s).

`kubectl apply --dry-run=client` downloads the OpenAPI schema from a server (kubectl 1.20 and
1.32 both do), so it cannot run here; this is the equivalent check without a cluster:
  * every object has apiVersion/kind/metadata.name, and a known apiVersion for its kind;
  * string-typed fields really are strings (args, env values, labels, annotations);
  * Deployments: selector matches the pod template's labels, containers have an image, their
    probes (readiness, liveness) are httpGet /health on a port the container declares, a preStop
    hook and terminationGracePeriodSeconds >= preStop sleep + --shutdown-timeout, volumeMounts
    name volumes of the pod, Secrets and PVCs the pods use exist in the render, prefill and
    decode containers request a GPU (nvidia.com/gpu, request == limit), pdserve flags exist in
    `pdserve <cmd> --help` (when the binary is given), --auth-token-file lies on a mounted volume;
  * Services select the pods of some Deployment and their targetPorts are ports those pods declare;
  * a decode worker's --prefill HOST:PORT and a worker's --router URL name a Service and its port;
  * PodDisruptionBudgets select a Deployment and leave it a pod to evict;
  * HPAs target an existing Deployment, Pods metrics have a name, min <= max, and the decode
    batch target is <= the decode workers' --max-num-seqs.
usage: check_k8s.py RENDERED.yaml [PDSERVE_BINARY]     exit 0 = ok, 1 = problems (listed)
"""
import re
import subprocess
import sys

import yaml

API = {
    "Namespace": {"v1"}, "Service": {"v1"}, "Secret": {"v1"}, "ConfigMap": {"v1"},
    "PersistentVolumeClaim": {"v1"}, "Deployment": {"apps/v1"}, "StatefulSet": {"apps/v1"},
    "PodDisruptionBudget": {"policy/v1"}, "HorizontalPodAutoscaler": {"autoscaling/v2"},
}
errors = []


def err(obj, msg):
    errors.append("%s/%s: %s" % (obj.get("kind", "?"), (obj.get("metadata") or {}).get("name", "?"), msg))


def subset(sel, labels):
    return bool(sel) and all(labels.get(k) == v for k, v in sel.items())


def flag(args, name):
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def check_strings(o, what, d):
    for k, v in (d or {}).items():
        if not isinstance(v, str):
            err(o, "%s %s is not a string (%r)" % (what, k, v))


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    with open(sys.argv[1]) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    binary = sys.argv[2] if len(sys.argv) > 2 else None
    helps = {}

    def help_of(cmd):
        if cmd not in helps:
            r = subprocess.run([binary, cmd, "--help"], capture_output=True, text=True, timeout=30)
            helps[cmd] = r.stdout + r.stderr
        return helps[cmd]

    by_kind = {}
    for o in docs:
        for k in ("apiVersion", "kind"):
            if not isinstance(o.get(k), str):
                err(o, "missing %s" % k)
        md = o.get("metadata") or {}
        if not md.get("name"):
            err(o, "missing metadata.name")
        if o.get("kind") in API and o.get("apiVersion") not in API[o["kind"]]:
            err(o, "apiVersion %s is not one of %s" % (o.get("apiVersion"), sorted(API[o["kind"]])))
        elif o.get("kind") not in API:
            err(o, "unexpected kind (add it to check_k8s.py's table if intended)")
        check_strings(o, "label", md.get("labels"))
        check_strings(o, "annotation", md.get("annotations"))
        by_kind.setdefault(o.get("kind"), {})[md.get("name")] = o

    deps = by_kind.get("Deployment", {})
    secrets = by_kind.get("Secret", {})
    pvcs = by_kind.get("PersistentVolumeClaim", {})
    services = by_kind.get("Service", {})
    pod_ports = {}  # deployment -> {port name or number}
    max_seqs = {}

    for name, d in deps.items():
        spec = d.get("spec") or {}
        tpl = spec.get("template") or {}
        labels = (tpl.get("metadata") or {}).get("labels") or {}
        check_strings(d, "pod label", labels)
        check_strings(d, "pod annotation", (tpl.get("metadata") or {}).get("annotations"))
        if not subset((spec.get("selector") or {}).get("matchLabels"), labels):
            err(d, "selector.matchLabels does not match the pod template's labels")
        pspec = tpl.get("spec") or {}
        vols = {v.get("name"): v for v in pspec.get("volumes") or []}
        for v in vols.values():
            if "secret" in v and v["secret"].get("secretName") not in secrets:
                err(d, "volume %s: Secret %s is not in the render" % (v["name"], v["secret"].get("secretName")))
            if "persistentVolumeClaim" in v and v["persistentVolumeClaim"].get("claimName") not in pvcs:
                err(d, "volume %s: PVC %s is not in the render" % (v["name"], v["persistentVolumeClaim"].get("claimName")))
        grace = pspec.get("terminationGracePeriodSeconds")
        ports = set()
        for c in (pspec.get("initContainers") or []) + (pspec.get("containers") or []):
            if not c.get("image"):
                err(d, "container %s has no image" % c.get("name"))
            for m in c.get("volumeMounts") or []:
                if m.get("name") not in vols:
                    err(d, "container %s mounts unknown volume %s" % (c.get("name"), m.get("name")))
            for a in (c.get("args") or []) + (c.get("command") or []):
                if not isinstance(a, str):
                    err(d, "container %s: arg %r is not a string" % (c.get("name"), a))
            for e in c.get("env") or []:
                if "value" in e and not isinstance(e["value"], str):
                    err(d, "env %s is not a string" % e.get("name"))
        if not pspec.get("containers"):
            err(d, "no containers")
        for c in pspec.get("containers") or []:
            cname = c.get("name")
            cports = set()
            for p in c.get("ports") or []:
                cports.add(p.get("name"))
                cports.add(p.get("containerPort"))
            ports |= cports
            for probe in ("readinessProbe", "livenessProbe"):
                pr = c.get(probe)
                if not pr:
                    err(d, "container %s has no %s" % (cname, probe))
                    continue
                hg = pr.get("httpGet") or {}
                if hg.get("path") != "/health":
                    err(d, "container %s: %s is not httpGet /health" % (cname, probe))
                if hg.get("port") not in cports:
                    err(d, "container %s: %s port %r is not a container port" % (cname, probe, hg.get("port")))
            args = [a for a in c.get("args") or [] if isinstance(a, str)]
            pre = ((c.get("lifecycle") or {}).get("preStop") or {})
            if not pre:
                err(d, "container %s has no preStop hook" % cname)
            sleep_s = 0
            cmd = (pre.get("exec") or {}).get("command") or []
            if len(cmd) == 2 and cmd[0] == "sleep":
                sleep_s = int(cmd[1])
            elif "sleep" in pre:
                sleep_s = int(pre["sleep"].get("seconds", 0))
            sdt = flag(args, "--shutdown-timeout")
            if sdt is None:
                err(d, "container %s: no --shutdown-timeout (graceful shutdown must match the grace period)" % cname)
            elif grace is None or int(grace) < sleep_s + int(sdt):
                err(d, "terminationGracePeriodSeconds %s < preStop %d s + --shutdown-timeout %s s" % (grace, sleep_s, sdt))
            tokf = flag(args, "--auth-token-file")
            if not tokf:
                err(d, "container %s: no --auth-token-file (KV and registration must authenticate)" % cname)
            elif not any(tokf.startswith(m.get("mountPath", "").rstrip("/") + "/") for m in c.get("volumeMounts") or []):
                err(d, "container %s: --auth-token-file %s is on no mounted volume" % (cname, tokf))
            role = flag(args, "--role")
            if role in ("prefill", "decode"):
                res = c.get("resources") or {}
                lim = (res.get("limits") or {}).get("nvidia.com/gpu")
                req = (res.get("requests") or {}).get("nvidia.com/gpu", lim)
                if not lim or str(lim) != str(req):
                    err(d, "container %s (role %s): nvidia.com/gpu limit missing or != request" % (cname, role))
            if role == "decode" and flag(args, "--max-num-seqs"):
                max_seqs[name] = int(flag(args, "--max-num-seqs"))
            if binary and args and not args[0].startswith("-"):
                text = help_of(args[0])
                for a in args[1:]:
                    if a.startswith("--") and not re.search(r"(^|[\s\[])" + re.escape(a) + r"([\s=\]]|$)", text, re.M):
                        err(d, "container %s: `pdserve %s --help` knows no flag %s" % (cname, args[0], a))
        pod_ports[name] = (labels, ports, grace)

    # StatefulSets (NATS): selector, image, probes and ports; their pods may back Services.
    for name, d in by_kind.get("StatefulSet", {}).items():
        spec = d.get("spec") or {}
        tpl = spec.get("template") or {}
        labels = (tpl.get("metadata") or {}).get("labels") or {}
        if not subset((spec.get("selector") or {}).get("matchLabels"), labels):
            err(d, "selector.matchLabels does not match the pod template's labels")
        ports = set()
        for c in (tpl.get("spec") or {}).get("containers") or []:
            if not c.get("image"):
                err(d, "container %s has no image" % c.get("name"))
            for p in c.get("ports") or []:
                ports.add(p.get("name"))
                ports.add(p.get("containerPort"))
            for probe in ("readinessProbe", "livenessProbe"):
                if not c.get(probe):
                    err(d, "container %s has no %s" % (c.get("name"), probe))
            for e in c.get("env") or []:
                ref = ((e.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name")
                if ref and ref not in secrets:
                    err(d, "env %s: Secret %s is not in the render" % (e.get("name"), ref))
        pod_ports[name] = (labels, ports, None)

    def svc_port(host, port):
        s = services.get(host.split(".")[0])
        return s is not None and any(str(p.get("port")) == str(port) for p in (s.get("spec") or {}).get("ports") or [])

    for name, s in services.items():
        sel = (s.get("spec") or {}).get("selector")
        hits = [dn for dn, (labels, _, _) in pod_ports.items() if subset(sel, labels)]
        if not hits:
            err(s, "selector %s matches no Deployment's or StatefulSet's pods" % sel)
        for p in (s.get("spec") or {}).get("ports") or []:
            tp = p.get("targetPort", p.get("port"))
            for dn in hits:
                if tp not in pod_ports[dn][1]:
                    err(s, "targetPort %r is not a port of %s's pods" % (tp, dn))

    for name, d in deps.items():
        for c in d["spec"]["template"]["spec"].get("containers") or []:
            args = [a for a in c.get("args") or [] if isinstance(a, str)]
            for i, a in enumerate(args):
                if a == "--prefill" and i + 1 < len(args) and flag(args, "--role") == "decode":
                    host, _, port = args[i + 1].rpartition(":")
                    if not svc_port(host, port):
                        err(d, "--prefill %s names no Service port" % args[i + 1])
            ctl = flag(args, "--control")
            if ctl:
                m = re.match(r"nats://([^:/]+):(\d+)$", ctl)
                if not m or not svc_port(m.group(1), m.group(2)):
                    err(d, "--control %s names no Service port" % ctl)
            r = flag(args, "--router")
            if r:
                m = re.match(r"https?://([^:/]+):(\d+)", r)
                if not m or not svc_port(m.group(1), m.group(2)):
                    err(d, "--router %s names no Service port" % r)

    for name, p in by_kind.get("PodDisruptionBudget", {}).items():
        sel = ((p.get("spec") or {}).get("selector") or {}).get("matchLabels")
        hits = [dn for dn, (labels, _, _) in pod_ports.items() if subset(sel, labels)]
        if not hits:
            err(p, "selects no Deployment's pods")
        ma = (p.get("spec") or {}).get("minAvailable")
        for dn in hits:
            if isinstance(ma, int) and ma >= int(deps[dn]["spec"].get("replicas", 1)):
                err(p, "minAvailable %d leaves %s (replicas %s) no pod to evict" % (ma, dn, deps[dn]["spec"].get("replicas", 1)))

    for name, h in by_kind.get("HorizontalPodAutoscaler", {}).items():
        spec = h.get("spec") or {}
        ref = spec.get("scaleTargetRef") or {}
        if ref.get("kind") != "Deployment" or ref.get("name") not in deps:
            err(h, "scaleTargetRef %s/%s is not a Deployment in the render" % (ref.get("kind"), ref.get("name")))
        if int(spec.get("minReplicas", 1)) > int(spec.get("maxReplicas", 0)):
            err(h, "minReplicas > maxReplicas")
        if not spec.get("metrics"):
            err(h, "no metrics")
        for m in spec.get("metrics") or []:
            if m.get("type") == "Pods":
                pm = m.get("pods") or {}
                if not (pm.get("metric") or {}).get("name") or not (pm.get("target") or {}).get("averageValue"):
                    err(h, "Pods metric without a name or an averageValue target")
                if (pm.get("metric") or {}).get("name") == "pdserve_num_requests_running" and ref.get("name") in max_seqs:
                    if float(pm["target"]["averageValue"]) > max_seqs[ref["name"]]:
                        err(h, "decode batch target %s > --max-num-seqs %d" % (pm["target"]["averageValue"], max_seqs[ref["name"]]))

    for e in errors:
        print("check_k8s: " + e)
    counts = ", ".join("%d %s" % (len(v), k) for k, v in sorted(by_kind.items(), key=lambda kv: str(kv[0])))
    print("check_k8s: %s (%s)" % ("ok" if not errors else "%d problem(s)" % len(errors), counts))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
