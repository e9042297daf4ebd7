#!/bin/sh
# test_k8s.sh — the Kubernetes manifests (deploy/k8s), offline (no cluster can be reached here):
#   1. `kubectl kustomize` (whatever kubectl is on PATH: Debian's kubernetes-client 1.20 or newer)
#      renders them, with a freshly generated auth token in a copy (the token is never committed);
#   2. tools/check_k8s.py passes on the render: the schema/consistency check that replaces
#      `kubectl apply --dry-run=client` (which downloads the OpenAPI schema from a server), with
#      every pdserve flag of the containers checked against `pdserve <cmd> --help`;
#   3. the check fails on broken copies: a selector that matches no pod, a probe off /health, a
#      grace period shorter than --shutdown-timeout, a flag pdserve does not know, no GPU request,
#      a decode --prefill that names no Service — so it cannot pass by accident.
here=$(cd "$(dirname "$0")" && pwd)
. "$here/lib/server.sh"
pd_setup
repo=$(cd "$here/../.." && pwd)
command -v kubectl >/dev/null || pd_fail "kubectl is needed (make deps installs kubernetes-client)"
command -v python3 >/dev/null || pd_fail "python3 is needed"
python3 -c 'import yaml' 2>/dev/null || pd_fail "python3-yaml is needed (make deps)"
# kubectl must never reach a server from a test (an unset config defaults to localhost:8080).
export KUBECONFIG="$TMP/no-kubeconfig"

render() {  # render DIR OUT
  kubectl kustomize "$1" >"$2" 2>"$TMP/kustomize.err" || { cat "$TMP/kustomize.err" >&2; return 1; }
}

cp -r "$repo/deploy/k8s" "$TMP/k8s"
rm -f "$TMP/k8s/auth-token"
render "$TMP/k8s" "$TMP/none.yaml" 2>/dev/null && pd_fail "kustomize rendered without an auth-token file (a default secret would ship)"
head -c 32 /dev/urandom | base64 >"$TMP/k8s/auth-token"
render "$TMP/k8s" "$TMP/r.yaml" || pd_fail "kubectl kustomize deploy/k8s failed"
grep -q 'kind: HorizontalPodAutoscaler' "$TMP/r.yaml" || pd_fail "render has no HPA"
python3 "$repo/tools/check_k8s.py" "$TMP/r.yaml" "$PD_BIN" || pd_fail "check_k8s found problems"

# Mutations: each must make the check fail (python on the parsed render; one change per copy).
cat >"$TMP/mutate.py" <<'PYEOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
def O(kind, name): return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)
def C(name): return O("Deployment", name)["spec"]["template"]["spec"]["containers"][0]
exec(sys.argv[3])
yaml.safe_dump_all(docs, open(sys.argv[2], "w"))
PYEOF
# the unmutated round trip through the helper passes (the mutations are what fail)
python3 "$TMP/mutate.py" "$TMP/r.yaml" "$TMP/m.yaml" 'pass' || pd_fail "round trip failed"
python3 "$repo/tools/check_k8s.py" "$TMP/m.yaml" "$PD_BIN" >/dev/null || pd_fail "the round-tripped render fails the check"
mutate() {  # mutate NAME PYTHON (statements on O(kind, name) and C(deployment), its first container)
  python3 "$TMP/mutate.py" "$TMP/r.yaml" "$TMP/m.yaml" "$2" || pd_fail "mutation '$1' could not be applied"
  if python3 "$repo/tools/check_k8s.py" "$TMP/m.yaml" "$PD_BIN" >"$TMP/m.out" 2>&1; then
    cat "$TMP/m.out" >&2; pd_fail "check_k8s passed with mutation '$1'"
  fi
  echo "ok: mutation '$1' caught: $(grep -m1 -v 'problem(s)' "$TMP/m.out")"
}
mutate selector       'O("Service", "pdserve-decode")["spec"]["selector"]["app.kubernetes.io/component"] = "decoder"'
mutate probe-path     'C("pdserve-prefill")["readinessProbe"]["httpGet"]["path"] = "/healthz"'
mutate probe-missing  'del C("pdserve-router")["livenessProbe"]'
mutate grace          'O("Deployment", "pdserve-decode")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 20'
mutate unknown-flag   'a = C("pdserve-decode")["args"]; a[a.index("--max-num-seqs")] = "--max-num-seq"'
mutate int-arg        'a = C("pdserve-router")["args"]; a[a.index("--port") + 1] = 8080'
mutate no-gpu         'del C("pdserve-prefill")["resources"]["limits"]["nvidia.com/gpu"]'
mutate prefill-target 'a = C("pdserve-decode")["args"]; a[a.index("--prefill") + 1] = "pdserve-prefill:9100"'
mutate target-port    'O("Service", "pdserve-prefill-kv")["spec"]["ports"][0]["targetPort"] = "kvport"'
mutate hpa-target     'O("HorizontalPodAutoscaler", "pdserve-decode")["spec"]["scaleTargetRef"]["name"] = "pdserve-dec"'
mutate no-auth        'a = C("pdserve-prefill")["args"]; i = a.index("--auth-token-file"); del a[i:i + 2]'
mutate pdb            'O("PodDisruptionBudget", "pdserve-router")["spec"]["minAvailable"] = 2'
mutate nats-url       'a = C("pdserve-router")["args"]; a[a.index("--control") + 1] = "nats://pdserve-nat:4222"'
mutate nats-secret    'O("StatefulSet", "pdserve-nats")["spec"]["template"]["spec"]["containers"][0]["env"][0]["valueFrom"]["secretKeyRef"]["name"] = "nope"'
echo "PASS test_k8s"
