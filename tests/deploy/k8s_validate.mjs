// Validates rendered Kubernetes manifests (a YAML stream) for //tests/deploy:k8s_manifests_test.
//
//   node k8s_validate.mjs NPM_DIR FLAGS_JSON MANIFESTS.yaml [MORE.yaml ...]
//
// 1. Every object against its OpenAPI schema from the npm package kubernetes-models (core
//    kinds) or @kubernetes-models/prometheus-operator (PodMonitor): types, enums, required
//    fields. Those generated validators ignore unknown fields, so every object is also walked
//    through a Proxy that records which fields the validator looked at: a field it never
//    looked at, in an object whose schema lists its fields, is unknown (a misspelling).
//    Objects whose schema is a map (labels, resources) are enumerated by the validator and
//    accept any key.
// 2. Consistency: every --flag given to a gradmesh binary (container args, and the lines of
//    the ConfigMap flagfile passed with --flagfile) exists in that binary's --helpfull
//    (FLAGS_JSON: {"gradmesh_worker": ["peer_port", ...], ...}); ConfigMaps, Secrets and PVCs
//    the pods use exist; Services and NetworkPolicies select pods and name their ports.
// Exit 0 and "OK n objects" when valid; 1 with one line per problem otherwise.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [npmDir, flagsJson, ...files] = process.argv.slice(2);
if (!npmDir || !flagsJson || files.length === 0) {
  console.error("usage: node k8s_validate.mjs NPM_DIR FLAGS_JSON MANIFESTS.yaml...");
  process.exit(2);
}
const nm = path.join(npmDir, "node_modules");
const YAML = await import(pathToFileURL(path.join(nm, "yaml/dist/index.js")).href);
const helpFlags = JSON.parse(fs.readFileSync(flagsJson, "utf8"));

const problems = [];
const problem = (where, msg) => problems.push(`${where}: ${msg}`);

// apiVersion -> where its schemas live and their name prefix.
const groups = {
  "v1": ["kubernetes-models/_schemas", "IoK8sApiCoreV1"],
  "apps/v1": ["kubernetes-models/_schemas", "IoK8sApiAppsV1"],
  "policy/v1": ["kubernetes-models/_schemas", "IoK8sApiPolicyV1"],
  "networking.k8s.io/v1": ["kubernetes-models/_schemas", "IoK8sApiNetworkingV1"],
  "monitoring.coreos.com/v1": [
    "@kubernetes-models/prometheus-operator/_schemas",
    "ComGithubPrometheusOperatorPrometheusOperatorPkgApisMonitoringV1",
  ],
};

async function schemaFor(apiVersion, kind) {
  const g = groups[apiVersion];
  if (!g || !/^[A-Z][A-Za-z]+$/.test(kind || "")) return null;
  const file = path.join(nm, g[0], `${g[1]}${kind}.js`);
  if (!fs.existsSync(file)) return null;
  return (await import(pathToFileURL(file).href)).validate;
}

// Deep copy of `value` in which every plain object is a Proxy recording what is read.
function instrument(value, where, records) {
  if (Array.isArray(value)) return value.map((v, i) => instrument(v, `${where}[${i}]`, records));
  if (value === null || typeof value !== "object") return value;
  const copy = {};
  for (const [k, v] of Object.entries(value)) copy[k] = instrument(v, `${where}.${k}`, records);
  const rec = { where, keys: Object.keys(copy), read: new Set(), enumerated: false };
  records.push(rec);
  return new Proxy(copy, {
    get(t, k, r) { if (typeof k === "string") rec.read.add(k); return Reflect.get(t, k, r); },
    has(t, k) { if (typeof k === "string") rec.read.add(k); return Reflect.has(t, k); },
    ownKeys(t) { rec.enumerated = true; return Reflect.ownKeys(t); },
  });
}

async function validateObject(obj, where) {
  const validate = await schemaFor(obj.apiVersion, obj.kind);
  if (!validate) {
    problem(where, `no schema for apiVersion ${obj.apiVersion} kind ${obj.kind}`);
    return;
  }
  const records = [];
  const ok = validate(instrument(obj, obj.kind, records));
  if (!ok) {
    for (const e of validate.errors || []) {
      problem(where, `${e.instancePath || "/"} ${e.keyword} ${JSON.stringify(e.params)}`);
    }
  }
  for (const rec of records) {
    if (rec.enumerated || rec.read.size === 0) continue;  // A map, or a free-form object.
    for (const k of rec.keys) {
      if (!rec.read.has(k)) problem(where, `unknown field ${rec.where}.${k}`);
    }
  }
}

// --- load -----------------------------------------------------------------------------
const objects = [];
for (const f of files) {
  for (const doc of YAML.parseAllDocuments(fs.readFileSync(f, "utf8"))) {
    if (doc.errors.length) { problem(f, `YAML: ${doc.errors[0].message}`); continue; }
    const o = doc.toJS();
    if (o) objects.push(o);
  }
}
const nameOf = (o) => `${o.kind}/${o.metadata?.name}`;
for (const o of objects) await validateObject(o, nameOf(o));

// --- consistency ----------------------------------------------------------------------
const byKind = (k) => objects.filter((o) => o.kind === k);
const names = (k) => new Set(byKind(k).map((o) => o.metadata.name));
const matches = (selector, labels) =>
  selector && Object.entries(selector).every(([k, v]) => labels?.[k] === v);
const workloads = byKind("StatefulSet");
const podsOf = (selector) => workloads.filter((w) => matches(selector, w.spec.template.metadata.labels));

function checkFlags(where, binary, args) {
  const known = helpFlags[binary];
  if (!known) { problem(where, `no --helpfull flags known for ${binary}`); return; }
  for (const a of args) {
    const m = /^--([A-Za-z0-9_]+)(=|$)/.exec(a);
    if (!m) { problem(where, `not a --flag: ${JSON.stringify(a)}`); continue; }
    if (!known.includes(m[1]) && !known.includes(m[1].replace(/^no/, ""))) {
      problem(where, `${binary} has no flag --${m[1]}`);
    }
  }
}

for (const w of workloads) {
  const spec = w.spec.template.spec;
  const where = nameOf(w);
  const volumes = Object.fromEntries((spec.volumes || []).map((v) => [v.name, v]));
  const claimTemplates = new Set((w.spec.volumeClaimTemplates || []).map((c) => c.metadata.name));
  for (const v of spec.volumes || []) {
    if (v.configMap && !names("ConfigMap").has(v.configMap.name)) problem(where, `volume ${v.name}: no ConfigMap ${v.configMap.name}`);
    if (v.secret && !names("Secret").has(v.secret.secretName)) problem(where, `volume ${v.name}: no Secret ${v.secret.secretName}`);
    if (v.persistentVolumeClaim && !names("PersistentVolumeClaim").has(v.persistentVolumeClaim.claimName)) {
      problem(where, `volume ${v.name}: no PersistentVolumeClaim ${v.persistentVolumeClaim.claimName}`);
    }
  }
  for (const c of [...(spec.initContainers || []), ...spec.containers]) {
    const cw = `${where} container ${c.name}`;
    for (const m of c.volumeMounts || []) {
      if (!volumes[m.name] && !claimTemplates.has(m.name)) problem(cw, `mount of unknown volume ${m.name}`);
    }
    const portNames = new Set((c.ports || []).map((p) => p.name));
    for (const probe of [c.readinessProbe, c.livenessProbe, c.startupProbe]) {
      const port = probe?.httpGet?.port ?? probe?.tcpSocket?.port;
      if (typeof port === "string" && !portNames.has(port)) problem(cw, `probe on unknown port ${port}`);
    }
    const binary = path.basename((c.command || [])[0] || "");
    if (!binary.startsWith("gradmesh")) { problem(cw, `command is not a gradmesh binary: ${c.command}`); continue; }
    const args = c.args || [];
    checkFlags(cw, binary, args);
    for (const a of args) {
      const m = /^--flagfile=(.*)$/.exec(a);
      if (!m) continue;
      const mount = (c.volumeMounts || []).find((vm) => m[1].startsWith(vm.mountPath + "/"));
      const cm = mount && volumes[mount.name]?.configMap;
      const data = cm && byKind("ConfigMap").find((o) => o.metadata.name === cm.name)?.data;
      const key = m[1].slice((mount?.mountPath || "").length + 1);
      if (!data || !(key in data)) { problem(cw, `--flagfile ${m[1]} is not in a mounted ConfigMap`); continue; }
      const lines = data[key].split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("#"));
      checkFlags(`${cw} ${key}`, binary, lines);
    }
  }
}

for (const s of byKind("Service")) {
  const pods = podsOf(s.spec.selector);
  if (pods.length === 0) { problem(nameOf(s), "selects no pods"); continue; }
  for (const p of s.spec.ports || []) {
    if (typeof p.targetPort !== "string") continue;
    const named = pods.every((w) => w.spec.template.spec.containers.some((c) => (c.ports || []).some((cp) => cp.name === p.targetPort)));
    if (!named) problem(nameOf(s), `targetPort ${p.targetPort} is not a container port of the selected pods`);
  }
}
for (const w of workloads) {
  if (!names("Service").has(w.spec.serviceName)) problem(nameOf(w), `serviceName ${w.spec.serviceName} is not a Service`);
}
for (const p of [...byKind("NetworkPolicy"), ...byKind("PodDisruptionBudget")]) {
  const sel = p.kind === "NetworkPolicy" ? p.spec.podSelector?.matchLabels : p.spec.selector?.matchLabels;
  if (sel && Object.keys(sel).length && podsOf(sel).length === 0) problem(nameOf(p), "selects no pods");
}
for (const m of byKind("PodMonitor")) {
  const pods = podsOf(m.spec.selector?.matchLabels);
  for (const e of m.spec.podMetricsEndpoints || []) {
    const missing = pods.filter((w) => !w.spec.template.spec.containers.some((c) => (c.ports || []).some((cp) => cp.name === e.port)));
    if (pods.length === 0 || missing.length) problem(nameOf(m), `port ${e.port} missing on ${missing.map(nameOf).join(", ") || "(no pods)"}`);
  }
}

if (problems.length) {
  for (const p of problems) console.log(`INVALID ${p}`);
  process.exit(1);
}
console.log(`OK ${objects.length} objects`);
