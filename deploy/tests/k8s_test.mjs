// SPDX-License-Identifier: Apache-2.0
// deploy_k8s: renders deploy/k8s/base and every overlay with `kubectl
// kustomize`, validates each object offline against the Kubernetes schemas of
// the pinned kubernetes-models packages (plus a strict unknown-field check, see
// lib.mjs), and checks what the schemas cannot see: probes on /health, llm-d
// role labels, headless Services that select exactly their role's pods on the
// pods' real ports, one autoscaler per worker role (an HPA or a KEDA
// ScaledObject, never both) aimed at an existing Deployment, queue-metric
// autoscaling wired end to end (every custom metric an HPA asks for is served
// by the prometheus-adapter rules in the output, every series the rules and
// the ScaledObjects query is one the workers export per docs/metrics.md, each
// query selects its own role, and every PromQL expression parses under
// promtool), the router's ConfigMap
// mounted as a directory (no subPath, no hash suffix), graceful-termination
// timings consistent with the drain timeout, the model volume and init step,
// Prometheus annotations and the PodMonitor, GPU resources in the gpu overlays
// only (a device-plugin GPU per worker, or one DRA claim shared by a pod's
// prefill and decode containers in gpu-one-pod) with --device cuda and a
// --kv-transfer choice, the router config's discovery names, and (when the
// binaries are built) every flag in the manifests against the binary's --help.
// Flags in PENDING_FLAGS may appear in the gpu overlays ahead of the binaries
// (reported as PENDING, never allowed in the cpu overlay). Finally it mutates
// a rendered overlay in known-bad ways and requires each check to notice.
//
//   node k8s_test.mjs --source-dir REPO [--kubectl kubectl] [--promtool promtool]
//        [--bin tandem-decode=PATH ...]
// KEDA's ScaledObject has no kubernetes-models package: it is validated
// against the minimal schema in schemas/ (written from KEDA's documentation)
// with ajv, the validator kubernetes-models itself uses.
// Exit 0 pass, 1 fail, 77 skipped (kubectl absent).
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import YAML from 'yaml';
import { Checker, checkFields, declarationOf, parseArgs, run, skip, which } from './lib.mjs';

const require = createRequire(import.meta.url);
const args = parseArgs(process.argv.slice(2), ['bin']);
const src = args['source-dir'];
if (!src) throw new Error('--source-dir is required');
const kubectl = which(args.kubectl || 'kubectl');
if (!kubectl) skip('kubectl not found (Debian: apt-get install kubernetes-client)');
const bins = Object.fromEntries((args.bin || []).map((b) => b.split(/=(.*)/s).slice(0, 2)));
const promtool = which(args.promtool || 'promtool');
const here = path.dirname(new URL(import.meta.url).pathname);

// apiVersion/kind -> model module; anything else in the output is an error,
// so no object escapes validation.
const MODELS = {
    'v1/Namespace': 'kubernetes-models/v1/Namespace',
    'v1/ConfigMap': 'kubernetes-models/v1/ConfigMap',
    'v1/Service': 'kubernetes-models/v1/Service',
    'v1/PersistentVolumeClaim': 'kubernetes-models/v1/PersistentVolumeClaim',
    'apps/v1/Deployment': 'kubernetes-models/apps/v1/Deployment',
    'autoscaling/v2/HorizontalPodAutoscaler': 'kubernetes-models/autoscaling/v2/HorizontalPodAutoscaler',
    'networking.k8s.io/v1/NetworkPolicy': 'kubernetes-models/networking.k8s.io/v1/NetworkPolicy',
    'monitoring.coreos.com/v1/PodMonitor': '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/PodMonitor',
};
const ROLE = 'llm-d.ai/role';
const WORKERS = ['prefill', 'decode'];
// Role label of a pod that runs both workers (the gpu-one-pod variant), llm-d's "both".
const BOTH = 'both';
// KEDA ScaledObject: the vendored schema (ajv comes with kubernetes-models'
// validator; strict: unknown fields are errors).
const AjvMod = require('ajv');
const Ajv = AjvMod.default || AjvMod;
const scaledObjectSchema = JSON.parse(readFileSync(path.join(here, 'schemas', 'keda.sh-v1alpha1-ScaledObject.json'), 'utf8'));
const validateScaledObject = new Ajv({ allErrors: true, strict: false }).compile(scaledObjectSchema);
// Kinds no kubernetes-models package covers: checked by hand here.
const CUSTOM = {
    'keda.sh/v1alpha1/ScaledObject': (o, w, c) => {
        if (validateScaledObject(o)) {
            c.passed++;
            return;
        }
        for (const e of validateScaledObject.errors) c.fail(w, `schema: ${e.instancePath || '/'} ${e.message}${e.params?.additionalProperty ? ` (${e.params.additionalProperty})` : ''}`);
    },
    // Dynamic Resource Allocation (resource.k8s.io/v1, Kubernetes 1.34).
    'resource.k8s.io/v1/ResourceClaimTemplate': (o, w, c) => {
        const reqs = o.spec?.spec?.devices?.requests;
        if (!c.check(Array.isArray(reqs) && reqs.length > 0, w, 'spec.spec.devices.requests is empty')) return;
        for (const r of reqs) {
            c.check(typeof r.name === 'string' && r.name, w, 'a device request has no name');
            c.check(typeof r.exactly?.deviceClassName === 'string', w, `request ${r.name}: no exactly.deviceClassName`);
            const known = new Set(['name', 'exactly', 'firstAvailable']);
            for (const k of Object.keys(r)) c.check(known.has(k), w, `request ${r.name}: unknown field ${k}`);
        }
        for (const k of Object.keys(o)) c.check(['apiVersion', 'kind', 'metadata', 'spec'].includes(k), w, `unknown field ${k}`);
    },
};
// Flags the gpu overlays use before the binaries have them: the flag -> the
// issue that adds it. Accepted (as PENDING) only in overlays/gpu*, and only
// while the binary answers "unknown option"; once it knows the flag, the
// normal check applies and the entry can go.
const PENDING_FLAGS = {
    // (none pending: --kv-transfer landed with issue 10)
};

// ---- rendering -----------------------------------------------------------------------
function render(dir) {
    const r = run(kubectl, ['kustomize', dir]);
    if (r.status !== 0) throw new Error(`kubectl kustomize ${dir} failed:\n${r.stderr}`);
    return YAML.parseAllDocuments(r.stdout).map((d) => {
        if (d.errors.length) throw new Error(`${dir}: ${d.errors[0].message}`);
        return d.toJS();
    }).filter(Boolean);
}

function validateSchemas(objs, where, c) {
    for (const o of objs) {
        const key = `${o.apiVersion}/${o.kind}`;
        const w = `${where} ${o.kind}/${o.metadata?.name}`;
        if (CUSTOM[key]) {
            CUSTOM[key](o, w, c);
            continue;
        }
        const mod = MODELS[key];
        if (!c.check(mod, w, `no schema for ${key} (add it to MODELS)`)) continue;
        const cls = Object.values(require(mod)).find((v) => typeof v === 'function' && v.kind === o.kind);
        try {
            new cls(o).validate();
            c.passed++;
        } catch (e) {
            c.fail(w, `schema: ${e.message}`);
        }
        checkFields(o, declarationOf(mod), w, (ww, m) => c.fail(ww, m));
    }
}

// ---- helpers over rendered objects ---------------------------------------------------------
const find = (objs, kind, name) => objs.find((o) => o.kind === kind && o.metadata?.name === name);
const all = (objs, kind) => objs.filter((o) => o.kind === kind);
const matches = (selector, labels) =>
    !!selector && Object.keys(selector).length > 0 &&
    Object.entries(selector).every(([k, v]) => labels?.[k] === v);
const podLabels = (d) => d.spec?.template?.metadata?.labels || {};
const podSpec = (d) => d.spec?.template?.spec || {};
const containers = (d) => podSpec(d).containers || [];
const allContainers = (d) => [...(podSpec(d).initContainers || []), ...containers(d)];
// The Deployment and container that run tandem-<role>: its own Deployment, or
// (gpu-one-pod) a container in another role's pods.
function workerOf(objs, role) {
    const bin = `tandem-${role}`;
    const runs = (d) => containers(d).find((ct) => ct.command?.[0] === bin);
    const own = find(objs, 'Deployment', bin);
    const d = own || all(objs, 'Deployment').find(runs);
    return d ? { d, ct: runs(d) || containers(d)[0], own: !!own } : null;
}

// The value of --name=V or --name V in a container's args (string) or null.
function flagValue(ct, name) {
    const a = ct.args || [];
    for (let i = 0; i < a.length; i++) {
        if (a[i] === `--${name}`) return a[i + 1] ?? null;
        if (a[i].startsWith(`--${name}=`)) return a[i].slice(name.length + 3);
    }
    return null;
}

// A probe/Service target port (name or number) -> the container port object.
function resolvePort(d, port) {
    for (const ct of containers(d)) {
        for (const p of ct.ports || []) {
            if (typeof port === 'number' ? p.containerPort === port : p.name === port) return p;
        }
    }
    return null;
}

function preStopSleep(ct) {
    const cmd = ct.lifecycle?.preStop?.exec?.command;
    if (cmd && cmd[0] === 'sleep') return Number(cmd[1]);
    if (ct.lifecycle?.preStop?.sleep) return Number(ct.lifecycle.preStop.sleep.seconds);
    return 0;
}

// ---- the checks ---------------------------------------------------------------------------
function checkRender(objs, overlay, c, promql = []) {
    const W = (what) => `${overlay}: ${what}`;
    const deps = all(objs, 'Deployment');
    const router = find(objs, 'Deployment', 'tandem-router');
    c.check(router, W('Deployment/tandem-router'), 'missing');

    for (const o of objs) {
        if (o.kind !== 'Namespace') {
            c.check(o.metadata?.namespace === 'tandem', W(`${o.kind}/${o.metadata?.name}`),
                `namespace is ${o.metadata?.namespace}, expected tandem (DNS discovery needs one namespace)`);
        }
    }

    // Every Deployment: probes on /health over a declared port, resources, non-root, one image.
    const images = new Set();
    for (const d of deps) {
        const w = W(`Deployment/${d.metadata.name}`);
        c.check(matches(d.spec?.selector?.matchLabels, podLabels(d)), w, 'selector does not match the pod template labels');
        for (const other of deps) {
            if (other !== d) {
                c.check(!matches(d.spec?.selector?.matchLabels, podLabels(other)), w,
                    `selector also matches the pods of ${other.metadata.name} (the two controllers would fight over them)`);
            }
        }
        c.check(podSpec(d).securityContext?.runAsNonRoot === true, w, 'pod securityContext.runAsNonRoot is not true');
        for (const ct of allContainers(d)) {
            images.add(ct.image);
            const r = ct.resources || {};
            for (const res of ['cpu', 'memory']) {
                c.check(r.requests?.[res] && r.limits?.[res], `${w} container ${ct.name}`, `resources.requests/limits.${res} missing`);
            }
        }
        for (const ct of containers(d)) {
            const wc = `${w} container ${ct.name}`;
            // The router's /health is 503 while no decode worker is healthy, so
            // its liveness uses /version (a restart cannot fix missing workers).
            const isRouter = d === router;
            for (const kind of ['readinessProbe', 'livenessProbe']) {
                const pr = ct[kind]?.httpGet;
                const want = isRouter && kind === 'livenessProbe' ? '/version' : '/health';
                if (c.check(pr, wc, `${kind} is not an httpGet probe`)) {
                    c.check(pr.path === want, wc, `${kind} path is ${pr.path}, expected ${want}`);
                    c.check(resolvePort(d, pr.port), wc, `${kind} port ${pr.port} is not a container port`);
                }
            }
            // Graceful termination: the preStop sleep plus the drain must fit in the
            // grace period, and liveness must not kill a pod while it drains (503).
            const drain = Number(flagValue(ct, 'drain-timeout') ?? 0); // 0: the service has no drain
            const grace = podSpec(d).terminationGracePeriodSeconds ?? 30;
            const sleep = preStopSleep(ct);
            c.check(sleep > 0, wc, 'no preStop delay: the pod would get SIGTERM before the router stops sending to it');
            c.check(grace > sleep + drain, wc, `terminationGracePeriodSeconds ${grace} <= preStop ${sleep} + drain-timeout ${drain}`);
            const lv = ct.livenessProbe || {};
            const tolerate = (lv.periodSeconds ?? 10) * (lv.failureThreshold ?? 3);
            c.check(tolerate > drain, wc, `liveness gives up after ${tolerate}s, before the ${drain}s drain ends`);
        }
    }
    c.check(images.size === 1, W('images'), `containers use ${images.size} images (${[...images].join(', ')}), expected one`);

    // Workers: role labels, their binary, a startup probe for the model load.
    const pvcs = new Set(all(objs, 'PersistentVolumeClaim').map((p) => p.metadata.name));
    const cms = new Map(all(objs, 'ConfigMap').map((m) => [m.metadata.name, m]));
    for (const role of WORKERS) {
        const wk = workerOf(objs, role);
        const w = W(`Deployment/tandem-${role}`);
        if (!c.check(wk, w, `missing (no Deployment runs tandem-${role})`)) continue;
        const { d, ct: main } = wk;
        const roles = wk.own ? [role, BOTH] : [BOTH];
        c.check(roles.includes(d.metadata.labels?.[ROLE]), w, `metadata label ${ROLE} is not ${roles.join(' or ')}`);
        c.check(roles.includes(podLabels(d)[ROLE]), w, `pod label ${ROLE} is not ${roles.join(' or ')}`);
        c.check(main?.command?.[0] === `tandem-${role}`, w, `${wk.own ? 'first container' : 'no container'} runs ${main?.command?.[0]}, expected tandem-${role}`);
        c.check(main?.startupProbe?.httpGet?.path === '/health', w, 'no startupProbe on /health (liveness would kill a pod loading its model)');
    }
    if (router) c.check(!podLabels(router)[ROLE], W('Deployment/tandem-router'), `router pods carry ${ROLE} (llm-d's decode-filter would take them for workers)`);

    // Every Tandem process takes the control plane's secret from the Secret the
    // docs have the operator create, not optional (a pod without it must not
    // start), and a NetworkPolicy admits only Tandem's pods to the workers.
    for (const d of deps) {
        const w = W(`Deployment/${d.metadata.name}`);
        for (const ct of containers(d).filter((x) => (x.command?.[0] || '').startsWith('tandem-'))) {
            const e = ct.env?.find((x) => x.name === 'TANDEM_INTERNAL_SECRET');
            c.check(e?.valueFrom?.secretKeyRef?.name === 'tandem-internal' && e.valueFrom.secretKeyRef.key === 'secret' &&
                !e.valueFrom.secretKeyRef.optional, w, `container ${ct.name}: TANDEM_INTERNAL_SECRET must come from Secret tandem-internal (key secret, not optional)`);
        }
    }
    const nps = all(objs, 'NetworkPolicy');
    const workerNp = nps.find((n) => (n.spec?.podSelector?.matchExpressions || []).some((m) => m.key === ROLE));
    if (c.check(workerNp, W('NetworkPolicy'), 'no NetworkPolicy selects the worker pods by role')) {
        c.check((workerNp.spec.ingress || []).every((r) => (r.from || []).length > 0), W(`NetworkPolicy/${workerNp.metadata.name}`),
            'an ingress rule without "from" opens the workers to every pod');
    }

    // Every service that loads the model (--model): the volume, read-only, and a download step before it.
    for (const d of deps) {
        const w = W(`Deployment/${d.metadata.name}`);
        const main = containers(d)[0];
        if (flagValue(main, 'model') !== null) {
            const vols = podSpec(d).volumes || [];
            const mv = vols.find((v) => v.persistentVolumeClaim);
            if (c.check(mv, w, 'no PersistentVolumeClaim volume for the model')) {
                c.check(pvcs.has(mv.persistentVolumeClaim.claimName), w, `PVC ${mv.persistentVolumeClaim.claimName} is not in the output`);
                const mm = main.volumeMounts?.find((m) => m.name === mv.name);
                c.check(mm && mm.readOnly === true, w, 'the serving container does not mount the model volume read-only');
            }
            const init = (podSpec(d).initContainers || []).find((ic) => (ic.args || []).join(' ').includes('tandem-download') ||
                (ic.command || []).includes('tandem-download'));
            if (c.check(init, w, 'no init container runs tandem-download')) {
                c.check(init.volumeMounts?.some((m) => m.name === mv?.name && !m.readOnly), w, 'download init container does not mount the model volume writable');
                const tok = init.env?.find((e) => e.name === 'HF_TOKEN');
                c.check(tok?.valueFrom?.secretKeyRef?.optional === true, w, 'HF_TOKEN must come from a Secret marked optional');
                c.check(init.env?.some((e) => e.name === 'HF_HOME'), w, 'HF_HOME not set for the download');
            }
        }
        // $(VAR) in args must be defined by env or envFrom of that container.
        for (const ct of allContainers(d)) {
            const names = new Set((ct.env || []).map((e) => e.name));
            for (const ef of ct.envFrom || []) {
                const cm = cms.get(ef.configMapRef?.name);
                if (c.check(cm, `${w} container ${ct.name}`, `envFrom ConfigMap ${ef.configMapRef?.name} is not in the output`)) {
                    Object.keys(cm.data || {}).forEach((k) => names.add(k));
                }
            }
            for (const a of ct.args || []) {
                for (const m of a.matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
                    c.check(names.has(m[1]), `${w} container ${ct.name}`, `args use $(${m[1]}), which no env defines`);
                }
            }
            // An nng inbox URL is what the service tells its peers: it must be routable.
            const nng = flagValue(ct, 'nng-url');
            if (nng !== null) {
                c.check(!/\/\/(0\.0\.0\.0|127\.|localhost)/.test(nng), `${w} container ${ct.name}`,
                    `--nng-url ${nng} is not reachable from other pods (bind the pod IP)`);
                const port = Number((/:(\d+)$/.exec(nng) || [])[1]);
                c.check(port && resolvePort(d, port), `${w} container ${ct.name}`, `--nng-url port ${port} is not a declared container port`);
            }
        }
    }

    // Headless discovery Services select exactly their role's pods, on the pods' real ports.
    for (const role of WORKERS) {
        const s = find(objs, 'Service', `tandem-${role}`);
        const w = W(`Service/tandem-${role}`);
        if (!c.check(s, w, 'missing')) continue;
        c.check(s.spec?.clusterIP === 'None', w, 'not headless (clusterIP: None): DNS would return one virtual IP, not the pods');
        c.check([role, BOTH].includes(s.spec?.selector?.[ROLE]), w, `selector lacks ${ROLE}=${role} (or ${BOTH})`);
        const sel = deps.filter((d) => matches(s.spec?.selector, podLabels(d)));
        const want = workerOf(objs, role)?.d.metadata.name;
        c.check(sel.length === 1 && sel[0].metadata.name === want, w,
            `selects ${sel.map((d) => d.metadata.name).join(', ') || 'no Deployment'}, expected ${want} only (the pods running tandem-${role})`);
        for (const p of s.spec?.ports || []) {
            const cp = sel[0] && resolvePort(sel[0], p.targetPort ?? p.port);
            if (c.check(cp, w, `port ${p.name} targets ${p.targetPort}, not a container port`)) {
                // Clients of a headless Service connect to pod IPs: the port must be the container's.
                c.check(cp.containerPort === p.port, w, `port ${p.name} is ${p.port} but the container listens on ${cp.containerPort}`);
            }
        }
    }
    const rs = find(objs, 'Service', 'tandem-router');
    if (c.check(rs, W('Service/tandem-router'), 'missing') && router) {
        const sel = deps.filter((d) => matches(rs.spec?.selector, podLabels(d)));
        c.check(sel.length === 1 && sel[0] === router, W('Service/tandem-router'), 'does not select the router pods only');
        for (const p of rs.spec?.ports || []) {
            c.check(resolvePort(router, p.targetPort ?? p.port), W('Service/tandem-router'), `port ${p.name} targets no container port`);
        }
    }

    // Autoscalers: one per worker role (an HPA, or a KEDA ScaledObject, which
    // makes its own HPA: both on one Deployment would fight), aimed at an
    // existing Deployment.
    const hpas = all(objs, 'HorizontalPodAutoscaler');
    const scaledObjects = all(objs, 'ScaledObject');
    for (const h of hpas) {
        const w = W(`HorizontalPodAutoscaler/${h.metadata.name}`);
        const t = h.spec?.scaleTargetRef || {};
        c.check(t.kind === 'Deployment' && t.apiVersion === 'apps/v1' && find(objs, 'Deployment', t.name), w,
            `scaleTargetRef ${t.apiVersion}/${t.kind}/${t.name} is not a Deployment in the output`);
        c.check((h.spec?.minReplicas ?? 1) <= h.spec?.maxReplicas, w, 'minReplicas > maxReplicas');
        const target = find(objs, 'Deployment', t.name);
        if (target && (h.spec?.metrics || []).some((m) => m.resource?.name === 'cpu')) {
            c.check(containers(target).every((ct) => ct.resources?.requests?.cpu), w, 'CPU utilisation needs cpu requests on every container');
        }
    }
    for (const so of scaledObjects) {
        const w = W(`ScaledObject/${so.metadata.name}`);
        const t = so.spec?.scaleTargetRef || {};
        c.check((t.kind ?? 'Deployment') === 'Deployment' && (t.apiVersion ?? 'apps/v1') === 'apps/v1' && find(objs, 'Deployment', t.name), w,
            `scaleTargetRef ${t.apiVersion}/${t.kind}/${t.name} is not a Deployment in the output`);
        c.check((so.spec?.minReplicaCount ?? 0) <= (so.spec?.maxReplicaCount ?? 100), w, 'minReplicaCount > maxReplicaCount');
    }
    for (const role of WORKERS) {
        const target = workerOf(objs, role)?.d.metadata.name;
        const byHpa = hpas.filter((h) => h.spec?.scaleTargetRef?.name === target).length;
        const bySo = scaledObjects.filter((so) => so.spec?.scaleTargetRef?.name === target).length;
        c.check(byHpa + bySo > 0, W(`HPA for ${role}`), `missing (no HPA or ScaledObject scales ${target})`);
        c.check(byHpa + bySo <= 1, W(`autoscaler for ${role}`), `${byHpa} HPA(s) and ${bySo} ScaledObject(s) scale ${target}: they would fight`);
    }
    checkQueueAutoscaling(objs, overlay, c, promql);

    // Router config: a ConfigMap mounted as a directory, never by subPath, with a fixed name.
    if (router) {
        const ct = containers(router)[0];
        const cfg = flagValue(ct, 'config');
        const w = W('Deployment/tandem-router');
        if (c.check(cfg, w, 'no --config flag')) {
            const dir = path.posix.dirname(cfg);
            const mount = (ct.volumeMounts || []).find((m) => m.mountPath === dir || m.mountPath === cfg);
            if (c.check(mount, w, `nothing is mounted at ${dir}`)) {
                c.check(!mount.subPath && !mount.subPathExpr, w,
                    'the config is mounted with subPath: the kubelet never updates such a mount, so a hot reload would never see changes');
                c.check(mount.mountPath === dir, w, `mount at ${mount.mountPath}: mount the directory ${dir}`);
                const vol = (podSpec(router).volumes || []).find((v) => v.name === mount.name);
                const cmName = vol?.configMap?.name;
                const cm = cms.get(cmName);
                if (c.check(cm, w, `config volume is not a ConfigMap in the output (${cmName})`)) {
                    c.check(cmName === 'tandem-router-config', w,
                        `ConfigMap is named ${cmName}: a hash suffix makes every edit a new ConfigMap and a router rollout`);
                    const key = path.posix.basename(cfg);
                    const items = vol.configMap.items;
                    c.check(items ? items.some((i) => i.path === key) : key in (cm.data || {}), w, `ConfigMap has no ${key}`);
                    if (cm.data?.[key]) checkRouterConfig(cm.data[key], objs, W(`ConfigMap/${cmName}`), c);
                }
            }
        }
    }

    // Prometheus: annotations on every pod and a PodMonitor selecting them all.
    const pms = all(objs, 'PodMonitor');
    c.check(pms.length >= 1, W('PodMonitor'), 'missing');
    for (const d of deps) {
        const w = W(`Deployment/${d.metadata.name}`);
        const an = d.spec?.template?.metadata?.annotations || {};
        c.check(an['prometheus.io/scrape'] === 'true', w, 'pod annotation prometheus.io/scrape is not "true"');
        const http = resolvePort(d, 'http');
        c.check(http && an['prometheus.io/port'] === String(http.containerPort), w,
            `prometheus.io/port ${an['prometheus.io/port']} is not the http container port ${http?.containerPort}`);
        c.check(an['prometheus.io/path'] === '/metrics', w, 'prometheus.io/path is not /metrics');
        const pm = pms.find((p) => matches(p.spec?.selector?.matchLabels, podLabels(d)));
        if (c.check(pm, w, 'no PodMonitor selects these pods')) {
            for (const ep of pm.spec.podMetricsEndpoints || []) {
                c.check(resolvePort(d, ep.port), w, `PodMonitor endpoint port ${ep.port} is not a container port here`);
            }
        }
    }

    // GPU: the gpu overlays give each worker container a GPU on GPU nodes (a
    // device-plugin nvidia.com/gpu, or a DRA claim of the pod that the pod's
    // workers share) and run it with --device cuda and a --kv-transfer
    // choice; nothing else asks for a GPU.
    const gpu = /\/gpu(-|$)/.test(overlay);
    const claimTemplates = new Set(all(objs, 'ResourceClaimTemplate').map((t) => t.metadata.name));
    for (const d of deps) {
        const w = W(`Deployment/${d.metadata.name}`);
        const podClaims = new Map((podSpec(d).resourceClaims || []).map((rc) => [rc.name, rc]));
        for (const rc of podClaims.values()) {
            c.check(rc.resourceClaimName || claimTemplates.has(rc.resourceClaimTemplateName), w,
                `resourceClaim ${rc.name}: template ${rc.resourceClaimTemplateName} is not in the output`);
        }
        for (const ct of containers(d)) {
            const wc = `${w} container ${ct.name}`;
            const worker = WORKERS.some((r) => ct.command?.[0] === `tandem-${r}`);
            const n = Number(ct.resources?.limits?.['nvidia.com/gpu'] ?? 0);
            const claims = (ct.resources?.claims || []).map((x) => x.name);
            for (const name of claims) c.check(podClaims.has(name), wc, `resources.claims names ${name}, which the pod does not declare`);
            if (gpu && worker) {
                c.check(n >= 1 || claims.length >= 1, wc, 'no GPU: neither an nvidia.com/gpu limit nor a resource claim');
                c.check(/^cuda(:\d+)?$/.test(flagValue(ct, 'device') ?? ''), wc, `--device is ${flagValue(ct, 'device')}, expected cuda (the CPU backend on a GPU node)`);
                c.check(['auto', 'nng', 'cuda-ipc', 'nccl'].includes(flagValue(ct, 'kv-transfer')), wc, `--kv-transfer is ${flagValue(ct, 'kv-transfer')}, expected auto|nng|cuda-ipc|nccl`);
                c.check(/cuda/.test(ct.image || ''), wc, `image ${ct.image} is not a CUDA build`);
            } else {
                c.check(n === 0 && claims.length === 0, wc, 'asks for a GPU outside the gpu overlays\' workers');
            }
        }
        if (gpu && containers(d).some((ct) => WORKERS.some((r) => ct.command?.[0] === `tandem-${r}`))) {
            c.check((podSpec(d).tolerations || []).some((t) => t.key === 'nvidia.com/gpu'), w, 'no toleration for nvidia.com/gpu');
            c.check(Object.keys(podSpec(d).nodeSelector || {}).some((k) => k.startsWith('nvidia.com/')), w, 'no GPU node selector');
            // Two workers sharing one GPU's claim copy KV over CUDA IPC: one pod, its IPC namespace shared.
            const shared = containers(d).filter((ct) => (ct.resources?.claims || []).length > 0);
            if (shared.length > 1) {
                c.check(podSpec(d).hostIPC !== true, w, "hostIPC: the pod's own IPC namespace, which its containers share, is enough for CUDA IPC");
            }
        }
    }
}

// The router's config (docs/router-config.md: endpoints.<role>.dns names,
// http_port, nng_port) names the headless Services of the right role, in the
// manifests' namespace, on the Services' ports.
// ---- queue-metric autoscaling ---------------------------------------------------------------
// The metric names the workers export (docs/metrics.md is their reference).
const EXPORTED = new Set([...readFileSync(path.join(src, 'docs', 'metrics.md'), 'utf8')
    .matchAll(/`((?:vllm|tandem):[a-z_]+)`/g)].map((m) => m[1].replace(/_(total|bucket|sum|count)$/, '')));
// Which role's queue each worker metric should steer.
const METRIC_ROLE = {
    'vllm:num_requests_waiting': 'decode',
    'vllm:kv_cache_usage_perc': 'decode',
    'tandem:num_prompt_tokens_waiting': 'prefill',
};
const ADAPTER_RULES = 'tandem-prometheus-adapter-rules';
// PromQL expressions of the real renders, checked with promtool at the end: [where, expr].
const promqlToCheck = [];

// Metric names a PromQL expression selects (identifiers followed by '{').
const seriesIn = (expr) => [...expr.matchAll(/([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{/g)].map((m) => m[1]);

function checkQueueAutoscaling(objs, overlay, c, promql) {
    const W = (what) => `${overlay}: ${what}`;
    // prometheus-adapter rules: the custom metric names they serve.
    const served = new Map(); // custom metric name -> series
    const cm = find(objs, 'ConfigMap', ADAPTER_RULES);
    if (cm) {
        const w = W(`ConfigMap/${ADAPTER_RULES}`);
        let cfg = null;
        try {
            cfg = YAML.parse(cm.data?.['config.yaml'] ?? '');
        } catch (e) {
            c.fail(w, `config.yaml: ${e.message}`);
        }
        const rules = cfg?.rules;
        if (c.check(Array.isArray(rules) && rules.length > 0, w, 'config.yaml has no rules')) {
            for (const [i, r] of rules.entries()) {
                const wr = `${w} rule ${i}`;
                const known = new Set(['seriesQuery', 'seriesFilters', 'resources', 'name', 'metricsQuery']);
                for (const k of Object.keys(r)) c.check(known.has(k), wr, `unknown field ${k}`);
                const series = seriesIn(r.seriesQuery || '');
                if (!c.check(series.length === 1, wr, `seriesQuery selects ${series.length} metrics, expected one`)) continue;
                c.check(EXPORTED.has(series[0]), wr, `${series[0]} is not a metric the workers export (docs/metrics.md)`);
                const ov = r.resources?.overrides || {};
                c.check(ov.namespace?.resource === 'namespace' && ov.pod?.resource === 'pod', wr,
                    'resources.overrides must map the namespace and pod labels (per-pod metrics for Pods-type HPA metrics)');
                let re = null;
                try {
                    re = new RegExp(r.name?.matches ?? '');
                } catch (e) {
                    c.fail(wr, `name.matches: ${e.message}`);
                }
                c.check(re && re.test(series[0]), wr, `name.matches ${r.name?.matches} does not match ${series[0]}`);
                const as = r.name?.as;
                if (c.check(typeof as === 'string' && /^[a-z0-9_]+$/.test(as), wr, `name.as ${as} is not a valid custom metric name`)) served.set(as, series[0]);
                const mq = r.metricsQuery || '';
                c.check(['<<.Series>>', '<<.LabelMatchers>>', '<<.GroupBy>>'].every((t) => mq.includes(t)), wr,
                    'metricsQuery must use <<.Series>>, <<.LabelMatchers>> and <<.GroupBy>>');
                promql.push([wr, mq.replaceAll('<<.Series>>', series[0])
                    .replaceAll('<<.LabelMatchers>>', 'namespace="tandem",pod=~"tandem-.*"').replaceAll('<<.GroupBy>>', 'pod')]);
                promql.push([`${wr} seriesQuery`, r.seriesQuery]);
            }
        }
    }
    // HPAs on custom metrics: each metric must be served, for the right role.
    for (const h of all(objs, 'HorizontalPodAutoscaler')) {
        const w = W(`HorizontalPodAutoscaler/${h.metadata.name}`);
        const role = WORKERS.find((r) => workerOf(objs, r)?.d.metadata.name === h.spec?.scaleTargetRef?.name);
        for (const m of h.spec?.metrics || []) {
            if (m.type === 'Resource') continue;
            const name = m.pods?.metric?.name ?? m.object?.metric?.name ?? m.external?.metric?.name;
            c.check(m.type === 'Pods', w, `metric ${name}: type ${m.type}, expected Pods (per-pod worker gauges)`);
            const series = served.get(name);
            if (!c.check(series, w, `metric ${name} is served by no prometheus-adapter rule in the output (ConfigMap ${ADAPTER_RULES})`)) continue;
            c.check(METRIC_ROLE[series] === role, w, `metric ${name} (${series}) steers ${METRIC_ROLE[series]}, not ${role}`);
            c.check(m.pods?.target?.type === 'AverageValue' && m.pods.target.averageValue, w, `metric ${name}: target must be an AverageValue`);
        }
    }
    // KEDA Prometheus triggers: worker series of this role, in this namespace.
    for (const so of all(objs, 'ScaledObject')) {
        const w = W(`ScaledObject/${so.metadata.name}`);
        const role = WORKERS.find((r) => workerOf(objs, r)?.d.metadata.name === so.spec?.scaleTargetRef?.name);
        for (const t of so.spec?.triggers || []) {
            if (t.type !== 'prometheus') continue;
            const q = t.metadata?.query || '';
            const wt = `${w} trigger ${t.name ?? t.type}`;
            for (const sname of seriesIn(q)) {
                c.check(EXPORTED.has(sname), wt, `${sname} is not a metric the workers export (docs/metrics.md)`);
                c.check(METRIC_ROLE[sname] === undefined || METRIC_ROLE[sname] === role, wt, `${sname} steers ${METRIC_ROLE[sname]}, not ${role}`);
            }
            c.check(seriesIn(q).length > 0, wt, 'the query selects no metric with a label matcher');
            c.check(q.includes(`role="${role}"`) && q.includes('namespace="tandem"'), wt,
                `the query must select role="${role}" and namespace="tandem" (another role's or namespace's pods would steer this one)`);
            c.check((t.metricType ?? 'AverageValue') === 'AverageValue' && /^\s*sum\s*\(/.test(q), wt,
                'use sum(...) with metricType AverageValue: KEDA divides by the replicas, so the threshold is a per-pod average');
            promql.push([wt, q]);
        }
    }
}

// PromQL expressions through `promtool check rules` (one recording rule each).
function checkPromql(exprs, c) {
    if (!exprs.length) return;
    if (!promtool) {
        notes.add(`PromQL of ${exprs.length} autoscaling queries not parsed: promtool not found`);
        return;
    }
    const dir = mkdtempSync(path.join(os.tmpdir(), 'deploy-k8s-promql-'));
    try {
        for (const [where, expr] of exprs) {
            const file = path.join(dir, 'rules.yml');
            writeFileSync(file, YAML.stringify({ groups: [{ name: 'q', rules: [{ record: 'q', expr }] }] }));
            const r = run(promtool, ['check', 'rules', file]);
            c.check(r.status === 0, where, `PromQL does not parse: ${expr}\n${r.stdout}${r.stderr}`);
        }
    } finally {
        rmSync(dir, { recursive: true, force: true });
    }
}

function checkRouterConfig(text, objs, w, c) {
    let cfg;
    try {
        cfg = YAML.parse(text);
    } catch (e) {
        c.fail(w, `router.yaml is not YAML: ${e.message}`);
        return;
    }
    for (const role of WORKERS) {
        const ep = cfg?.endpoints?.[role];
        const dns = (Array.isArray(ep) ? [] : ep?.dns || []).map((d) => (typeof d === 'string' ? d : d?.name));
        if (!c.check(dns.length > 0, w, `router.yaml has no endpoints.${role}.dns name (pods must be discovered, not listed)`)) continue;
        for (const name of dns) {
            const [svc, ns] = String(name).split('.');
            const s = find(objs, 'Service', svc);
            if (!c.check(s && s.spec?.clusterIP === 'None', w, `endpoints.${role}.dns ${name}: ${svc} is not a headless Service in the output`)) continue;
            c.check(!ns || ns === s.metadata.namespace, w, `endpoints.${role}.dns ${name}: namespace ${ns}, the Service is in ${s.metadata.namespace}`);
            c.check([role, BOTH].includes(s.spec.selector?.[ROLE]), w, `endpoints.${role}.dns ${name} selects ${ROLE}=${s.spec.selector?.[ROLE]}`);
            const ports = (s.spec.ports || []).map((p) => p.port);
            c.check(ports.includes(ep.http_port), w, `endpoints.${role}.http_port ${ep.http_port} is not a port of ${svc} (${ports})`);
            if (role === 'prefill') {
                c.check(ports.includes(ep.nng_port), w, `endpoints.prefill.nng_port ${ep.nng_port} is not a port of ${svc} (${ports})`);
            }
        }
    }
}

// Every --flag a container passes must be in its binary's --help (when built).
function checkFlags(objs, overlay, c) {
    const helps = {};
    const helpOf = (bin) => {
        if (!(bin in helps)) {
            const p = bins[bin];
            if (!p) return (helps[bin] = null);
            if (!existsSync(p)) {
                c.fail(`${overlay}: ${bin}`, `${p} does not exist (build the service targets first)`);
                return (helps[bin] = null);
            }
            const r = run(p, ['--help']);
            helps[bin] = new Set(`${r.stdout}\n${r.stderr}`.match(/--[a-z][a-z0-9-]*/g) || []);
        }
        return helps[bin];
    };
    // A flag its --help does not list may still be parsed (a binary can take
    // some flags out before its main parser): then run the binary with just
    // that flag, which every Tandem binary rejects with "unknown option" when
    // it does not know it (and otherwise stops at a missing required flag).
    const accepts = (bin, arg) => {
        const a = arg.replace(/\$\([A-Za-z_]\w*\)/g, '10.0.0.1');
        const r = run(bins[bin], [a], { timeout: 5000 });
        return !/unknown (or incomplete )?option|unrecognized/i.test(`${r.stdout}\n${r.stderr}`);
    };
    const checkCall = (bin, argv, w) => {
        const h = helpOf(bin);
        if (h === null) return;
        for (const arg of argv.filter((a) => a.startsWith('--'))) {
            const f = arg.split('=')[0];
            if (h.has(f)) {
                c.passed++;
            } else if (accepts(bin, arg)) {
                c.passed++;
                notes.add(`NOTE: ${bin} accepts ${f} but its --help does not list it`);
            } else if (PENDING_FLAGS[f] && /(^|\/)gpu(-|$)/.test(overlay.replace(/^overlays\//, ''))) {
                c.passed++;
                notes.add(`PENDING: ${bin} has no ${f} yet (${PENDING_FLAGS[f]}); the gpu overlays use it ahead of the binary`);
            } else {
                c.fail(w, `${bin} has no flag ${f} (not in its --help, and it answers "unknown option")`);
            }
        }
    };
    for (const d of all(objs, 'Deployment')) {
        for (const ct of allContainers(d)) {
            const w = `${overlay}: Deployment/${d.metadata.name} container ${ct.name}`;
            const cmd = ct.command || [];
            if (cmd[0]?.startsWith('tandem-')) {
                checkCall(cmd[0], [...cmd.slice(1), ...(ct.args || [])], w);
            } else {
                // A shell script: each line calling a tandem-* binary.
                for (const line of (ct.args || []).join('\n').split('\n')) {
                    const m = /^\s*(tandem-[a-z]+)\s+(.*)$/.exec(line);
                    if (m) checkCall(m[1], m[2].match(/(?<=^|\s)--[a-z][a-z0-9-]*/g) || [], w);
                }
            }
        }
    }
}

// ---- main --------------------------------------------------------------------------------
const c = new Checker('deploy_k8s');
const notes = new Set();
const k8s = path.join(src, 'deploy', 'k8s');
const overlaysDir = path.join(k8s, 'overlays');
const targets = [['base', path.join(k8s, 'base')],
    ...readdirSync(overlaysDir).filter((n) => existsSync(path.join(overlaysDir, n, 'kustomization.yaml')))
        .map((n) => [`overlays/${n}`, path.join(overlaysDir, n)])];
c.check(['cpu', 'gpu', 'gpu-one-pod'].every((o) => targets.some(([n]) => n === `overlays/${o}`)), 'overlays', 'cpu, gpu and gpu-one-pod overlays expected');
const rendered = {};
for (const [name, dir] of targets) {
    try {
        rendered[name] = render(dir);
    } catch (e) {
        c.fail(name, e.message);
        continue;
    }
    console.log(`rendered ${name}: ${rendered[name].length} objects`);
    validateSchemas(rendered[name], name, c);
    checkRender(rendered[name], name, c, promqlToCheck);
    checkFlags(rendered[name], name, c);
}
checkPromql(promqlToCheck, c);
c.check(['cpu-autoscale-adapter', 'cpu-autoscale-keda'].every((o) => rendered[`overlays/${o}`]), 'overlays',
    'the queue-autoscaling overlays cpu-autoscale-adapter and cpu-autoscale-keda are expected');
for (const b of Object.keys(bins)) console.log(`flags checked against ${b} --help`);

// gpu-one-pod's router config is the base's with the prefill ports moved to
// the prefill container's: nothing else may drift apart.
function routerConfigOf(objs) {
    const cm = find(objs || [], 'ConfigMap', 'tandem-router-config');
    return cm ? YAML.parse(cm.data['router.yaml']) : null;
}
{
    const base = routerConfigOf(rendered['base']);
    const one = routerConfigOf(rendered['overlays/gpu-one-pod']);
    const pod = find(rendered['overlays/gpu-one-pod'] || [], 'Deployment', 'tandem-decode');
    if (c.check(base && one && pod, 'overlays/gpu-one-pod: router config', 'missing')) {
        const pre = containers(pod).find((ct) => ct.command?.[0] === 'tandem-prefill');
        const ports = (pre?.ports || []).map((p) => p.containerPort);
        c.check(ports.includes(one.endpoints?.prefill?.http_port) && ports.includes(one.endpoints?.prefill?.nng_port),
            'overlays/gpu-one-pod: router config', `prefill ports ${one.endpoints?.prefill?.http_port}/${one.endpoints?.prefill?.nng_port} are not the prefill container's (${ports})`);
        const strip = (cfg) => {
            const x = structuredClone(cfg);
            delete x.endpoints.prefill.http_port;
            delete x.endpoints.prefill.nng_port;
            return JSON.stringify(x);
        };
        c.check(strip(base) === strip(one), 'overlays/gpu-one-pod: router config',
            'differs from deploy/k8s/base/router-config.yaml beyond the prefill ports (copy the change over)');
    }
}
for (const n of notes) console.log(n);

// Self-test: each mutation of a good render must be caught by checkRender.
const MUTATIONS = [
    ['readiness probe removed', 'overlays/cpu', (o) => delete find(o, 'Deployment', 'tandem-decode').spec.template.spec.containers[0].readinessProbe],
    ['liveness path changed', 'overlays/cpu', (o) => (find(o, 'Deployment', 'tandem-prefill').spec.template.spec.containers[0].livenessProbe.httpGet.path = '/healthz')],
    ['router liveness on /health', 'overlays/cpu', (o) => (find(o, 'Deployment', 'tandem-router').spec.template.spec.containers[0].livenessProbe.httpGet.path = '/health')],
    ['overlapping Deployment selectors', 'overlays/cpu', (o) => delete find(o, 'Deployment', 'tandem-decode').spec.selector.matchLabels['app.kubernetes.io/component']],
    ['role label swapped', 'overlays/cpu', (o) => (find(o, 'Deployment', 'tandem-decode').spec.template.metadata.labels[ROLE] = 'prefill')],
    ['headless Service given a cluster IP', 'overlays/cpu', (o) => delete find(o, 'Service', 'tandem-prefill').spec.clusterIP],
    ['Service port differs from the container', 'overlays/cpu', (o) => (find(o, 'Service', 'tandem-decode').spec.ports[0].port = 80)],
    ['HPA aimed at a missing Deployment', 'overlays/cpu', (o) => (find(o, 'HorizontalPodAutoscaler', 'tandem-decode').spec.scaleTargetRef.name = 'tandem-decoder')],
    ['config mounted with subPath', 'overlays/cpu', (o) => (find(o, 'Deployment', 'tandem-router').spec.template.spec.containers[0].volumeMounts[0].subPath = 'router.yaml')],
    ['grace period shorter than the drain', 'overlays/cpu', (o) => (find(o, 'Deployment', 'tandem-decode').spec.template.spec.terminationGracePeriodSeconds = 20)],
    ['GPU limit dropped', 'overlays/gpu', (o) => delete find(o, 'Deployment', 'tandem-decode').spec.template.spec.containers[0].resources.limits['nvidia.com/gpu']],
    ['GPU worker on the CPU backend', 'overlays/gpu', (o) => {
        const a = find(o, 'Deployment', 'tandem-prefill').spec.template.spec.containers[0].args;
        a.splice(a.indexOf('--device=cuda'), 1);
    }],
    ['no --kv-transfer choice', 'overlays/gpu', (o) => {
        const a = find(o, 'Deployment', 'tandem-decode').spec.template.spec.containers[0].args;
        a.splice(a.indexOf('--kv-transfer=auto'), 1);
    }],
    ['one-pod prefill container without the GPU claim', 'overlays/gpu-one-pod', (o) => delete find(o, 'Deployment', 'tandem-decode').spec.template.spec.containers[1].resources.claims],
    ['one-pod claim template missing', 'overlays/gpu-one-pod', (o) => o.splice(o.findIndex((x) => x.kind === 'ResourceClaimTemplate'), 1)],
    ['one-pod prefill Service on the decode ports', 'overlays/gpu-one-pod', (o) => {
        const p = find(o, 'Service', 'tandem-prefill').spec.ports[0];
        p.port = 8001;
        p.targetPort = 'http';
    }],
    ['one-pod without a prefill container', 'overlays/gpu-one-pod', (o) => find(o, 'Deployment', 'tandem-decode').spec.template.spec.containers.pop()],
    ['one-pod pods labelled decode only', 'overlays/gpu-one-pod', (o) => (find(o, 'Deployment', 'tandem-decode').spec.template.metadata.labels[ROLE] = 'decode')],
    ['GPU asked for in the cpu overlay', 'overlays/cpu', (o) => (find(o, 'Deployment', 'tandem-prefill').spec.template.spec.containers[0].resources.limits['nvidia.com/gpu'] = 1)],
    ['prometheus port annotation wrong', 'overlays/cpu', (o) => (find(o, 'Deployment', 'tandem-router').spec.template.metadata.annotations['prometheus.io/port'] = '9090')],
    ['router config names a missing Service', 'overlays/cpu', (o) => {
        const cm = find(o, 'ConfigMap', 'tandem-router-config');
        cm.data['router.yaml'] = cm.data['router.yaml'].replaceAll('tandem-prefill.', 'tandem-prefil.');
    }],
    ['router config on the wrong port', 'overlays/cpu', (o) => {
        const cm = find(o, 'ConfigMap', 'tandem-router-config');
        cm.data['router.yaml'] = cm.data['router.yaml'].replaceAll('nng_port: 9001', 'nng_port: 9200');
    }],
    ['nng inbox on the loopback address', 'overlays/cpu', (o) => {
        const a = find(o, 'Deployment', 'tandem-router').spec.template.spec.containers[0].args;
        a[a.findIndex((x) => x.startsWith('--nng-url'))] = '--nng-url=tcp://127.0.0.1:9000';
    }],
    ['internal secret optional', 'overlays/cpu', (o) => {
        const ct = find(o, 'Deployment', 'tandem-decode').spec.template.spec.containers[0];
        ct.env.find((e) => e.name === 'TANDEM_INTERNAL_SECRET').valueFrom.secretKeyRef.optional = true;
    }],
    ['worker NetworkPolicy open to all', 'overlays/cpu', (o) => (find(o, 'NetworkPolicy', 'tandem-workers').spec.ingress[0].from = [])],
    ['HPA and ScaledObject on one Deployment', 'overlays/cpu-autoscale-keda', (o) => o.push(structuredClone(find(rendered['overlays/cpu'], 'HorizontalPodAutoscaler', 'tandem-decode')))],
    ['ScaledObject aimed at a missing Deployment', 'overlays/cpu-autoscale-keda', (o) => (find(o, 'ScaledObject', 'tandem-prefill').spec.scaleTargetRef.name = 'tandem-prefil')],
    ['ScaledObject query on another role', 'overlays/cpu-autoscale-keda', (o) => {
        const t = find(o, 'ScaledObject', 'tandem-decode').spec.triggers[0];
        t.metadata.query = t.metadata.query.replace('role="decode"', 'role="prefill"');
    }],
    ['ScaledObject query on a metric nobody exports', 'overlays/cpu-autoscale-keda', (o) => {
        const t = find(o, 'ScaledObject', 'tandem-prefill').spec.triggers[0];
        t.metadata.query = t.metadata.query.replace('tandem:num_prompt_tokens_waiting', 'tandem:prompt_tokens_waiting');
    }],
    ['ScaledObject threshold per deployment (Value)', 'overlays/cpu-autoscale-keda', (o) => (find(o, 'ScaledObject', 'tandem-decode').spec.triggers[0].metricType = 'Value')],
    ['no autoscaler for decode', 'overlays/cpu-autoscale-keda', (o) => o.splice(o.findIndex((x) => x.kind === 'ScaledObject' && x.metadata.name === 'tandem-decode'), 1)],
    ['HPA metric the adapter does not serve', 'overlays/cpu-autoscale-adapter', (o) => (find(o, 'HorizontalPodAutoscaler', 'tandem-decode').spec.metrics[0].pods.metric.name = 'vllm_num_requests_queued')],
    ['adapter rules dropped', 'overlays/cpu-autoscale-adapter', (o) => o.splice(o.findIndex((x) => x.kind === 'ConfigMap' && x.metadata.name === 'tandem-prometheus-adapter-rules'), 1)],
    ['prefill HPA on the decode queue', 'overlays/cpu-autoscale-adapter', (o) => (find(o, 'HorizontalPodAutoscaler', 'tandem-prefill').spec.metrics[0].pods.metric.name = 'vllm_num_requests_waiting')],
    ['adapter rule without the pod mapping', 'overlays/cpu-autoscale-adapter', (o) => {
        const cm = find(o, 'ConfigMap', 'tandem-prometheus-adapter-rules');
        cm.data['config.yaml'] = cm.data['config.yaml'].replace('pod: {resource: pod}', 'instance: {resource: pod}');
    }],
    ['HF token Secret not optional', 'overlays/cpu', (o) => (find(o, 'Deployment', 'tandem-decode').spec.template.spec.initContainers[0].env.find((e) => e.name === 'HF_TOKEN').valueFrom.secretKeyRef.optional = false)],
];
for (const [what, overlay, mutate] of MUTATIONS) {
    if (!rendered[overlay]) continue;
    const copy = structuredClone(rendered[overlay]);
    try {
        mutate(copy);
    } catch (e) {
        c.fail(`self-test "${what}"`, `cannot apply the mutation (${e.message})`);
        continue;
    }
    const probe = new Checker('probe');
    checkRender(copy, overlay, probe);
    c.check(probe.errors.length > 0, `self-test "${what}"`, 'the checks did not notice');
}
// The flag check must catch a flag the binary does not have.
if (bins['tandem-decode'] && rendered['overlays/cpu']) {
    const copy = structuredClone(rendered['overlays/cpu']);
    find(copy, 'Deployment', 'tandem-decode').spec.template.spec.containers[0].args.push('--no-such-flag=1');
    const probe = new Checker('probe');
    checkFlags(copy, 'probe', probe);
    c.check(probe.errors.length === 1, 'self-test "unknown flag"', `flag check reported ${probe.errors.length} errors`);
}
// A pending flag the binary lacks is an error outside the gpu overlays.
if (bins['tandem-decode'] && rendered['overlays/cpu']) {
    const help = run(bins['tandem-decode'], ['--help']);
    const lacking = Object.keys(PENDING_FLAGS).filter((f) => !`${help.stdout}\n${help.stderr}`.includes(f));
    for (const f of lacking) {
        const copy = structuredClone(rendered['overlays/cpu']);
        find(copy, 'Deployment', 'tandem-decode').spec.template.spec.containers[0].args.push(`${f}=cuda`);
        const probe = new Checker('probe');
        checkFlags(copy, 'overlays/cpu', probe);
        c.check(probe.errors.length === 1, `self-test "pending flag ${f} in the cpu overlay"`, `flag check reported ${probe.errors.length} errors`);
    }
}
// The ScaledObject schema must catch a misspelt field and a bad threshold.
for (const [what, mutate] of [
    ['misspelt ScaledObject field', (so) => (so.spec.maxReplicas = 8)],
    ['non-numeric KEDA threshold', (so) => (so.spec.triggers[0].metadata.threshold = 'two')],
    ['Prometheus trigger without a query', (so) => delete so.spec.triggers[0].metadata.query],
]) {
    const so = structuredClone(find(rendered['overlays/cpu-autoscale-keda'] || [], 'ScaledObject', 'tandem-decode') || null);
    if (!so) continue;
    mutate(so);
    const probe = new Checker('probe');
    CUSTOM['keda.sh/v1alpha1/ScaledObject'](so, 'probe', probe);
    c.check(probe.errors.length > 0, `self-test "${what}"`, 'the ScaledObject schema did not notice');
}
// promtool must reject a broken query.
if (promtool) {
    const probe = new Checker('probe');
    checkPromql([['probe', 'sum(vllm:num_requests_waiting{namespace="tandem",role="decode"}']], probe);
    c.check(probe.errors.length === 1, 'self-test "PromQL syntax error"', `promtool check reported ${probe.errors.length} errors`);
}
// The strict field check must catch a misspelt field.
{
    const probe = new Checker('probe');
    const d = structuredClone(find(rendered['overlays/cpu'] || [], 'Deployment', 'tandem-decode') || {});
    if (d.spec) {
        d.spec.template.spec.containers[0].readinesProbe = {};
        checkFields(d, declarationOf(MODELS['apps/v1/Deployment']), 'probe', (w, m) => probe.fail(w, m));
        c.check(probe.errors.length === 1, 'self-test "misspelt field"', `strict field check reported ${probe.errors.length} errors`);
    }
}
c.report();
