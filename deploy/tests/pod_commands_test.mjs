// SPDX-License-Identifier: Apache-2.0
// deploy_pod_commands: runs what the cpu overlay's pods would run, on this
// machine, with the built binaries. For each Deployment (decode, prefill,
// router) it plays the pod's start: the model-download init script (with the
// real tandem-download, on a tiny model made by tandem-mkmodel and given as a
// local folder) twice, as a restarted pod would; then the serving container's
// command with its args and env expanded as the kubelet does ($(VAR) from env,
// envFrom and the downward API). Volumes become folders under the work dir
// (the PVC one shared folder, the router's ConfigMap its files), and so that
// the test can run beside others on a shared machine the listening ports are
// replaced by free ones and the CPU/memory sizing by small values (listed in
// the output). Then: the probes answer as the manifests expect (readiness on
// the workers, liveness everywhere), /metrics has the role's metrics, the
// router loaded the ConfigMap's config (GET /v1/router/config), and SIGTERM
// ends each service with exit 0 within the grace period minus preStop.
//
//   node pod_commands_test.mjs --source-dir REPO --workdir DIR [--kubectl K] --bin NAME=PATH ...
// Exit 0 pass, 1 fail, 77 skipped (kubectl or a service binary absent).
import { randomBytes } from 'node:crypto';
import { spawn } from 'node:child_process';
import { existsSync, mkdirSync, readlinkSync, realpathSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import http from 'node:http';
import path from 'node:path';
import YAML from 'yaml';
import { Checker, parseArgs, run, skip, which } from './lib.mjs';

const args = parseArgs(process.argv.slice(2), ['bin']);
const src = args['source-dir'];
const work = args.workdir;
// One control-plane secret for every pod of the run, as a cluster's Secret gives them.
const internalSecret = randomBytes(24).toString('hex');
if (!src || !work) throw new Error('--source-dir and --workdir are required');
const kubectl = which(args.kubectl || 'kubectl');
if (!kubectl) skip('kubectl not found (Debian: apt-get install kubernetes-client)');
const bins = Object.fromEntries((args.bin || []).map((b) => b.split(/=(.*)/s).slice(0, 2)));
for (const b of ['tandem-router', 'tandem-prefill', 'tandem-decode', 'tandem-download', 'tandem-mkmodel']) {
    if (!bins[b] || !existsSync(bins[b])) skip(`${b} is not built`);
}
const c = new Checker('deploy_pod_commands');
const SMALL = { threads: '1', 'kv-cache-memory': '64MiB' };

// ---- helpers -------------------------------------------------------------------------------
function freePort() {
    return new Promise((resolve, reject) => {
        const s = net.createServer();
        s.listen(0, '127.0.0.1', () => {
            const { port } = s.address();
            s.close(() => resolve(port));
        });
        s.on('error', reject);
    });
}

function get(port, p, timeoutMs = 2000) {
    return new Promise((resolve) => {
        const req = http.get({ host: '127.0.0.1', port, path: p, timeout: timeoutMs }, (res) => {
            let body = '';
            res.on('data', (d) => (body += d));
            res.on('end', () => resolve({ status: res.statusCode, body }));
        });
        req.on('timeout', () => req.destroy(new Error('timeout')));
        req.on('error', () => resolve({ status: 0, body: '' }));
    });
}

async function waitStatus(port, p, want, seconds, proc) {
    const t0 = Date.now();
    let last = { status: 0 };
    while (Date.now() - t0 < seconds * 1000) {
        if (proc.exitCode !== null) return { status: -1, body: `exited with ${proc.exitCode}` };
        last = await get(port, p);
        if (last.status === want) return last;
        await new Promise((r) => setTimeout(r, 200));
    }
    return last;
}

const expand = (s, env) => s.replace(/\$\(([A-Za-z_]\w*)\)/g, (m, k) => (k in env ? env[k] : m));

// ---- one pod ---------------------------------------------------------------------------------
async function playPod(d, objs, shared) {
    const name = d.metadata.name;
    const spec = d.spec.template.spec;
    const ann = d.spec.template.metadata.annotations || {};
    const cms = new Map(objs.filter((o) => o.kind === 'ConfigMap').map((m) => [m.metadata.name, m]));
    // Volumes -> local folders.
    const volDir = {};
    for (const v of spec.volumes || []) {
        if (v.persistentVolumeClaim) volDir[v.name] = shared.models;
        else if (v.configMap) {
            const dir = path.join(work, name, v.name);
            mkdirSync(dir, { recursive: true });
            for (const [k, text] of Object.entries(cms.get(v.configMap.name)?.data || {})) writeFileSync(path.join(dir, k), text);
            volDir[v.name] = dir;
        } else {
            volDir[v.name] = path.join(work, name, v.name);
            mkdirSync(volDir[v.name], { recursive: true });
        }
    }
    // A path inside one of the container's mounts -> the same path in its folder.
    const local = (ct, s) => {
        const mounts = [...(ct.volumeMounts || [])].sort((a, b) => b.mountPath.length - a.mountPath.length);
        for (const m of mounts) {
            if (s === m.mountPath || s.startsWith(`${m.mountPath}/`)) return volDir[m.name] + s.slice(m.mountPath.length);
        }
        return s;
    };
    const localArg = (ct, a) => {
        const m = /^(--[a-z-]+=)(.*)$/.exec(a);
        return m ? m[1] + local(ct, m[2]) : local(ct, a);
    };
    const envOf = (ct) => {
        const env = {};
        for (const ef of ct.envFrom || []) Object.assign(env, cms.get(ef.configMapRef.name)?.data || {});
        for (const e of ct.env || []) {
            if (e.value !== undefined) env[e.name] = e.value;
            else if (e.valueFrom?.fieldRef?.fieldPath === 'status.podIP') env[e.name] = '127.0.0.1';
            else if (e.valueFrom?.secretKeyRef?.name === 'tandem-internal') env[e.name] = internalSecret; // the Secret docs/kubernetes.md has the operator create
            else if (e.valueFrom?.secretKeyRef?.optional) continue; // no Secret here: skipped, as the kubelet does
            else c.fail(`${name} container ${ct.name}`, `env ${e.name} has a source the test cannot play`);
        }
        // Only the manifest's values are paths inside the pod. The test's own
        // PATH (the build folder) and the local model folder are paths on this
        // machine and stay as they are, wherever the checkout lives (a clone
        // under /tmp used to have its PATH rewritten into the pod's /tmp volume).
        for (const k of Object.keys(env)) env[k] = local(ct, env[k]);
        env.PATH = `${path.dirname(bins['tandem-download'])}:/usr/bin:/bin`;
        env.HOSTNAME ??= `${name}-test`;
        env.MODEL_ID = shared.modelSource; // a local folder instead of a Hub id: no network
        return env;
    };

    // Init containers, twice (a restarted pod runs them again over the same volume).
    for (const ic of spec.initContainers || []) {
        const env = envOf(ic);
        const cmd = [...(ic.command || []), ...(ic.args || [])].map((a) => localArg(ic, a));
        for (const round of [1, 2]) {
            const r = run(cmd[0], cmd.slice(1), { env, timeout: 60000 });
            c.check(r.status === 0, `${name} init ${ic.name} (run ${round})`, `exit ${r.status}: ${r.stderr.trim()}`);
        }
        if (env.MODEL_PATH) {
            let target = '';
            try {
                target = readlinkSync(env.MODEL_PATH);
            } catch (e) {
                target = '';
            }
            c.check(target && existsSync(path.join(env.MODEL_PATH, 'config.json')), `${name} init ${ic.name}`,
                `MODEL_PATH ${env.MODEL_PATH} is not a link to a model folder (${target || 'missing'})`);
            c.check(!existsSync(`${env.MODEL_PATH}.${env.HOSTNAME}`), `${name} init ${ic.name}`, 'temporary link left behind');
        }
    }

    // The serving container.
    const ct = spec.containers[0];
    const env = envOf(ct);
    const portMap = new Map();
    for (const p of ct.ports || []) portMap.set(p.containerPort, await freePort());
    const subst = [];
    const argv = (ct.args || []).map((a) => {
        let x = expand(localArg(ct, a), env);
        const m = /^--([a-z-]+)=(.*)$/.exec(x);
        if (m && SMALL[m[1]] !== undefined) {
            subst.push(`${m[1]}=${SMALL[m[1]]}`);
            return `--${m[1]}=${SMALL[m[1]]}`;
        }
        x = x.replace(/^(--port=)(\d+)$/, (_, f, p) => f + (portMap.get(Number(p)) ?? p));
        x = x.replace(/^(--nng-url=tcp:\/\/[^:]+:)(\d+)$/, (_, f, p) => f + (portMap.get(Number(p)) ?? p));
        return x;
    });
    console.log(`${name}: ${ct.command.join(' ')} ${argv.join(' ')}${subst.length ? `   (test sizing: ${subst.join(', ')})` : ''}`);
    const bin = bins[ct.command[0]];
    if (!c.check(bin, name, `no built binary for ${ct.command[0]}`)) return;
    const logFile = path.join(work, `${name}.log`);
    const proc = spawn(bin, [...ct.command.slice(1), ...argv], { env, stdio: ['ignore', 'pipe', 'pipe'] });
    let log = '';
    proc.stdout.on('data', (b) => (log += b));
    proc.stderr.on('data', (b) => (log += b));
    const exited = new Promise((resolve) => proc.on('exit', (code, sig) => resolve({ code, sig })));
    try {
        const httpPort = portMap.get(ct.ports.find((p) => p.name === 'http').containerPort);
        const isRouter = ct.command[0] === 'tandem-router';
        // Liveness must answer once started; workers must also become ready.
        const lv = await waitStatus(httpPort, ct.livenessProbe.httpGet.path, 200, 60, proc);
        c.check(lv.status === 200, `${name}`, `liveness ${ct.livenessProbe.httpGet.path} answered ${lv.status} ${lv.body.slice(0, 200)}`);
        if (!isRouter) {
            const rd = await waitStatus(httpPort, ct.readinessProbe.httpGet.path, 200, 60, proc);
            c.check(rd.status === 200, `${name}`, `readiness ${ct.readinessProbe.httpGet.path} answered ${rd.status}`);
        } else {
            // No worker resolves here (the config names cluster DNS): not ready, as the manifest intends.
            const rd = await get(httpPort, ct.readinessProbe.httpGet.path);
            c.check(rd.status === 503, `${name}`, `readiness without workers answered ${rd.status}, expected 503`);
            const rc = await get(httpPort, '/v1/router/config');
            let cfg = null;
            try {
                cfg = JSON.parse(rc.body);
            } catch {
                cfg = null;
            }
            c.check(rc.status === 200 && cfg, `${name}`, `/v1/router/config answered ${rc.status}`);
            c.check(JSON.stringify(cfg || {}).includes('tandem-decode.tandem.svc.cluster.local'), `${name}`,
                'the active config is not the ConfigMap\'s (no tandem-decode DNS name in /v1/router/config)');
        }
        const mport = portMap.get(Number(ann['prometheus.io/port'])) ?? httpPort;
        const m = await get(mport, ann['prometheus.io/path'] || '/metrics');
        const want = isRouter ? 'tandem:router_' : 'vllm:num_requests_running';
        c.check(m.status === 200 && m.body.includes(want), `${name}`, `metrics at the annotated port/path lack ${want} (status ${m.status})`);
        // SIGTERM: a clean exit within the grace period minus the preStop delay.
        const grace = spec.terminationGracePeriodSeconds ?? 30;
        const sleep = Number(ct.lifecycle?.preStop?.exec?.command?.[1] ?? 0);
        const t0 = Date.now();
        proc.kill('SIGTERM');
        const end = await Promise.race([exited, new Promise((r) => setTimeout(() => r(null), (grace - sleep) * 1000))]);
        c.check(end && end.code === 0, `${name}`, end ? `SIGTERM: exit ${end.code} signal ${end.sig}` : `still running ${grace - sleep}s after SIGTERM`);
        if (end) console.log(`${name}: stopped ${((Date.now() - t0) / 1000).toFixed(1)}s after SIGTERM`);
    } finally {
        if (proc.exitCode === null) proc.kill('SIGKILL');
        await exited;
        writeFileSync(logFile, log);
        if (c.errors.some((e) => e.startsWith(name))) console.log(`--- ${name} log (${logFile}):\n${log.slice(-3000)}`);
    }
}

// ---- main ---------------------------------------------------------------------------------
rmSync(work, { recursive: true, force: true });
mkdirSync(work, { recursive: true });
const model = path.join(work, 'model-src');
const mk = run(bins['tandem-mkmodel'], ['--out', model, '--preset', 'tiny']);
if (mk.status !== 0) {
    c.fail('tandem-mkmodel', mk.stderr);
    c.report();
}
const r = run(kubectl, ['kustomize', path.join(src, 'deploy', 'k8s', 'overlays', 'cpu')]);
if (r.status !== 0) {
    c.fail('kubectl kustomize', r.stderr);
    c.report();
}
const objs = YAML.parseAllDocuments(r.stdout).map((d) => d.toJS()).filter(Boolean);
const shared = { models: path.join(work, 'pvc-models'), modelSource: realpathSync(model) };
mkdirSync(shared.models, { recursive: true });
for (const n of ['tandem-decode', 'tandem-prefill', 'tandem-router']) {
    const d = objs.find((o) => o.kind === 'Deployment' && o.metadata.name === n);
    if (c.check(d, n, 'missing from the cpu overlay')) await playPod(d, objs, shared);
}
c.report();
