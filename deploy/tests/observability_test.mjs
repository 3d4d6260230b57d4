// SPDX-License-Identifier: Apache-2.0
// deploy_observability: checks deploy/observability/.
//  - prometheus.yml and prometheus-local.yml pass `promtool check config`
//    (Debian's Prometheus is built without Kubernetes discovery, so there the
//    kubernetes_sd_configs block is swapped for a static one before the check
//    and the relabelling rules are still checked); the Kubernetes job keeps
//    pods by the prometheus.io/* annotations the manifests set, and the local
//    job has a loopback target for each role, labelled as the pods are.
//  - grafana-dashboard.json: a well-formed dashboard (unique panel ids, a grid
//    that fits 24 columns without overlaps, the datasource and every $variable
//    defined), every query valid PromQL (`promtool check rules` over a rule
//    file made from the queries), every metric it names documented in docs/,
//    and the required views present (running/waiting/KV per pod, TTFT and
//    inter-token percentiles, P/D decisions, KV transfer time).
// A self-test then breaks a copy of the dashboard and requires the checks to
// notice.
//
//   node observability_test.mjs --source-dir REPO [--promtool promtool] [--workdir DIR]
// Exit 0 pass, 1 fail, 77 skipped (promtool absent).
import { mkdirSync, readFileSync, readdirSync, writeFileSync } from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import YAML from 'yaml';
import { Checker, parseArgs, run, skip, which } from './lib.mjs';

const args = parseArgs(process.argv.slice(2));
const src = args['source-dir'];
if (!src) throw new Error('--source-dir is required');
const promtool = which(args.promtool || 'promtool');
if (!promtool) skip('promtool not found (Debian: apt-get install prometheus)');
const work = args.workdir || path.join(os.tmpdir(), `tandem-deploy-obs-${process.pid}`);
mkdirSync(work, { recursive: true });
const obs = path.join(src, 'deploy', 'observability');
const c = new Checker('deploy_observability');

// ---- the manifests' ports and annotations, read straight from the base ----------------------
function basePorts() {
    const dir = path.join(src, 'deploy', 'k8s', 'base');
    const ports = {};
    let namespace = null;
    for (const f of readdirSync(dir).filter((n) => n.endsWith('.yaml'))) {
        for (const doc of YAML.parseAllDocuments(readFileSync(path.join(dir, f), 'utf8'))) {
            const o = doc.toJS();
            if (f === 'kustomization.yaml') namespace = o?.namespace;
            if (o?.kind !== 'Deployment') continue;
            const comp = o.spec.template.metadata.labels['app.kubernetes.io/component'];
            const http = o.spec.template.spec.containers[0].ports.find((p) => p.name === 'http');
            ports[comp] = { port: http.containerPort, ann: o.spec.template.metadata.annotations || {} };
        }
    }
    return { ports, namespace };
}

// ---- Prometheus configs -----------------------------------------------------------------
function promtoolCheckConfig(file, label) {
    const r = run(promtool, ['check', 'config', '--syntax-only', file]);
    c.check(r.status === 0, label, `promtool check config failed:\n${r.stdout}${r.stderr}`);
}

function checkPrometheus() {
    const { ports, namespace } = basePorts();
    // Kubernetes variant.
    const kfile = path.join(obs, 'prometheus.yml');
    const k = YAML.parse(readFileSync(kfile, 'utf8'));
    const probe = path.join(work, 'k8s-sd-probe.yml');
    writeFileSync(probe, 'scrape_configs:\n- job_name: p\n  kubernetes_sd_configs:\n  - role: pod\n');
    const hasK8sSd = run(promtool, ['check', 'config', '--syntax-only', probe]).status === 0;
    if (hasK8sSd) promtoolCheckConfig(kfile, 'prometheus.yml');
    else {
        console.log('NOTE: this promtool has no kubernetes_sd_configs (Debian build); checking prometheus.yml with it replaced by static_configs');
        const copy = structuredClone(k);
        for (const j of copy.scrape_configs || []) {
            if (j.kubernetes_sd_configs) {
                delete j.kubernetes_sd_configs;
                j.static_configs = [{ targets: ['127.0.0.1:1'] }];
            }
        }
        const f = path.join(work, 'prometheus-static.yml');
        writeFileSync(f, YAML.stringify(copy));
        promtoolCheckConfig(f, 'prometheus.yml (static copy)');
    }
    const job = (k.scrape_configs || []).find((j) => j.kubernetes_sd_configs);
    if (c.check(job, 'prometheus.yml', 'no job with kubernetes_sd_configs')) {
        const sd = job.kubernetes_sd_configs[0];
        c.check(sd.role === 'pod', 'prometheus.yml', `kubernetes_sd role is ${sd.role}, expected pod`);
        c.check(!sd.namespaces || sd.namespaces.names.includes(namespace), 'prometheus.yml',
            `discovers namespaces ${sd.namespaces?.names}, the manifests use ${namespace}`);
        const rl = job.relabel_configs || [];
        const uses = (label) => rl.some((r) => (r.source_labels || []).includes(label));
        c.check(rl.some((r) => r.action === 'keep' && r.source_labels?.includes('__meta_kubernetes_pod_annotation_prometheus_io_scrape')),
            'prometheus.yml', 'does not keep pods by the prometheus.io/scrape annotation');
        c.check(uses('__meta_kubernetes_pod_annotation_prometheus_io_port'), 'prometheus.yml', 'ignores the prometheus.io/port annotation');
        c.check(uses('__meta_kubernetes_pod_annotation_prometheus_io_path'), 'prometheus.yml', 'ignores the prometheus.io/path annotation');
        c.check(uses('__meta_kubernetes_pod_label_llm_d_ai_role'), 'prometheus.yml', 'does not copy the llm-d.ai/role label');
    }
    for (const [comp, p] of Object.entries(ports)) {
        c.check(p.ann['prometheus.io/scrape'] === 'true', `base ${comp}`, 'pods not annotated prometheus.io/scrape');
    }
    // Local variant: one loopback target per role, labelled like the pods.
    const lfile = path.join(obs, 'prometheus-local.yml');
    promtoolCheckConfig(lfile, 'prometheus-local.yml');
    const l = YAML.parse(readFileSync(lfile, 'utf8'));
    const statics = (l.scrape_configs || []).flatMap((j) => j.static_configs || []);
    for (const comp of Object.keys(ports)) {
        const sc = statics.find((s) => s.labels?.component === comp);
        c.check(sc && sc.targets.every((t) => /^127\.0\.0\.1:\d+$/.test(t)), 'prometheus-local.yml', `no loopback target labelled component=${comp}`);
        if (comp !== 'router') c.check(sc?.labels?.role === comp, 'prometheus-local.yml', `the ${comp} target has no role=${comp} label`);
    }
    c.check(Object.keys(ports).length === 3, 'base', `found ${Object.keys(ports).length} Deployments, expected 3`);
}

// ---- Grafana dashboard ---------------------------------------------------------------------
const PROMQL_WORDS = new Set(['by', 'without', 'on', 'ignoring', 'group_left', 'group_right', 'offset', 'bool', 'and', 'or', 'unless']);

// Metric names in a PromQL expression: identifiers with a ':' (all of Tandem's
// and vLLM's), histogram suffixes removed; label values in quotes skipped.
function metricsOf(expr) {
    const bare = expr.replace(/"(?:[^"\\]|\\.)*"/g, '""');
    const out = new Set();
    for (const m of bare.matchAll(/[a-zA-Z_:][a-zA-Z0-9_:]*/g)) {
        const id = m[0];
        if (!id.includes(':') || PROMQL_WORDS.has(id)) continue;
        out.add(id.replace(/_(bucket|sum|count)$/, ''));
    }
    return out;
}

// The services' own references (docs/metrics.md, the router and prefill docs);
// the deployment guides that describe this dashboard do not count.
const OWN_DOCS = new Set(['observability.md', 'kubernetes.md']);
function documentedText() {
    const dir = path.join(src, 'docs');
    return readdirSync(dir).filter((n) => n.endsWith('.md') && !OWN_DOCS.has(n)).map((n) => readFileSync(path.join(dir, n), 'utf8')).join('\n');
}

const REQUIRED = [
    ['running requests per pod', /vllm:num_requests_running/],
    ['waiting requests per pod', /vllm:num_requests_waiting/],
    ['KV usage per pod', /vllm:kv_cache_usage_perc/],
    ['TTFT percentiles', /histogram_quantile\([^,]+,[^;]*?vllm:time_to_first_token_seconds_bucket/],
    ['inter-token percentiles', /histogram_quantile\([^,]+,[^;]*?vllm:inter_token_latency_seconds_bucket/],
    ['P/D decisions', /tandem:router_pd_decision_total/],
    ['KV transfer time', /histogram_quantile\([^,]+,[^;]*?tandem:kv_transfer_seconds_bucket/],
];

// Checks a dashboard object; promql=true also runs promtool over the queries.
function checkDashboard(d, label, chk, docs, promql) {
    chk.check(typeof d.title === 'string' && d.title, label, 'no title');
    chk.check(typeof d.uid === 'string' && /^[a-zA-Z0-9_-]{1,40}$/.test(d.uid), label, 'uid missing or not a Grafana uid');
    chk.check(Number.isInteger(d.schemaVersion), label, 'no schemaVersion');
    const vars = new Map((d.templating?.list || []).map((v) => [v.name, v]));
    chk.check(vars.get('datasource')?.type === 'datasource' && vars.get('datasource')?.query === 'prometheus', label,
        'no datasource variable of type prometheus');
    const ids = new Set();
    const cells = [];
    const exprs = [];
    const panels = d.panels || [];
    chk.check(panels.length > 0, label, 'no panels');
    for (const p of panels) {
        const w = `${label} panel ${p.id} "${p.title}"`;
        chk.check(Number.isInteger(p.id) && !ids.has(p.id), w, 'id missing or duplicated');
        ids.add(p.id);
        const g = p.gridPos || {};
        if (chk.check([g.x, g.y, g.w, g.h].every(Number.isInteger) && g.x >= 0 && g.w > 0 && g.x + g.w <= 24 && g.h > 0, w, `gridPos ${JSON.stringify(g)} outside the 24-column grid`)) {
            for (const o of cells) {
                const overlap = g.x < o.x + o.w && o.x < g.x + g.w && g.y < o.y + o.h && o.y < g.y + g.h;
                chk.check(!overlap, w, `overlaps panel ${o.id}`);
            }
            cells.push({ ...g, id: p.id });
        }
        if (p.type === 'row') continue;
        chk.check(p.datasource?.uid === '${datasource}', w, 'datasource is not the ${datasource} variable');
        const targets = p.targets || [];
        chk.check(targets.length > 0, w, 'no queries');
        for (const t of targets) {
            const e = t.expr || '';
            if (!chk.check(e.trim(), w, `query ${t.refId} is empty`)) continue;
            exprs.push([w, e]);
            for (const v of e.matchAll(/\$(?:\{)?([a-zA-Z_][a-zA-Z0-9_]*)/g)) {
                chk.check(v[1].startsWith('__') || vars.has(v[1]), w, `uses $${v[1]}, which the dashboard does not define`);
            }
            const ms = metricsOf(e);
            chk.check(ms.size > 0, w, `query names no metric: ${e}`);
            for (const m of ms) chk.check(docs.includes(m), w, `metric ${m} is not documented in docs/`);
            for (const hq of e.matchAll(/histogram_quantile\(\s*([0-9.]+)\s*,([\s\S]*)/g)) {
                chk.check(/_bucket\b/.test(hq[2]) && /by\s*\([^)]*\ble\b/.test(hq[2]), w, 'histogram_quantile over something other than _bucket summed by le');
            }
        }
    }
    const all = exprs.map(([, e]) => e).join(';\n');
    for (const [what, re] of REQUIRED) chk.check(re.test(all), label, `no panel shows ${what}`);
    if (promql && exprs.length) {
        // promtool validates PromQL inside rule files; Grafana's variables become
        // what they expand to.
        const rules = exprs.map(([, e], i) => ({
            record: `tandem_dashboard:q${i}`,
            expr: e.replaceAll('$__rate_interval', '5m').replaceAll('$__interval', '1m').replace(/\$\{?[a-zA-Z_]\w*\}?/g, '.*'),
        }));
        const f = path.join(work, `${label.replace(/\W+/g, '_')}-rules.yml`);
        writeFileSync(f, YAML.stringify({ groups: [{ name: 'dashboard', rules }] }));
        const r = run(promtool, ['check', 'rules', f]);
        chk.check(r.status === 0, label, `a query is not valid PromQL:\n${r.stdout}${r.stderr}`);
    }
}

checkPrometheus();
const docs = documentedText();
const dfile = path.join(obs, 'grafana-dashboard.json');
let dash = null;
try {
    dash = JSON.parse(readFileSync(dfile, 'utf8'));
    c.passed++;
} catch (e) {
    c.fail('grafana-dashboard.json', `not JSON: ${e.message}`);
}
if (dash) {
    checkDashboard(dash, 'grafana-dashboard.json', c, docs, true);
    // Self-test: broken copies must fail.
    const firstQuery = (d) => d.panels.find((p) => p.targets?.length).targets[0];
    const MUTATIONS = [
        ['undocumented metric', (d) => (firstQuery(d).expr = 'sum(vllm:made_up_metric_total)')],
        ['invalid PromQL', (d) => (firstQuery(d).expr = 'sum(rate(vllm:num_requests_running[5m])')],
        ['undefined variable', (d) => (firstQuery(d).expr = 'sum(vllm:num_requests_running{pod=~"$nope"})')],
        ['duplicate panel id', (d) => (d.panels[2].id = d.panels[1].id)],
        ['overlapping panels', (d) => (d.panels[2].gridPos = { ...d.panels[1].gridPos })],
        ['P/D decisions missing', (d) => d.panels.forEach((p) => (p.targets || []).forEach((t) => (t.expr = t.expr.replaceAll('tandem:router_pd_decision_total', 'vllm:num_requests_running'))))],
    ];
    for (const [what, mutate] of MUTATIONS) {
        const copy = structuredClone(dash);
        mutate(copy);
        const probe = new Checker('probe');
        checkDashboard(copy, `selftest-${what}`, probe, docs, what === 'invalid PromQL');
        c.check(probe.errors.length > 0, `self-test "${what}"`, 'the checks did not notice');
    }
}
c.report();
