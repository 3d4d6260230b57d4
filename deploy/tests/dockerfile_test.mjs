// SPDX-License-Identifier: Apache-2.0
// deploy_dockerfile: static checks of deploy/Dockerfile (no container engine
// is needed or used).
//  - Shape: two or more stages, every base image Debian bookworm with an
//    explicit tag; apt-get update and install in one RUN with
//    --no-install-recommends and the lists removed; the build configures with
//    CMAKE_BUILD_TYPE=Release and builds named targets that exist in the
//    source tree (add_executable); the runtime stage copies from the build
//    stage (by default: a stage that only aliases another, FROM ${BINARIES},
//    is followed with the ARG defaults to the stage that runs cmake --build;
//    the other choice, prebuilt, is deploy/image/build.sh --runtime-from),
//    installs no -dev package or toolchain, runs as a non-root USER,
//    and uses exec-form CMD/ENTRYPOINT; no ADD; a .dockerignore for the
//    context that leaves out build trees and .git.
//  - Build packages: every REQUIRED dependency in the CMake files
//    (pkg_check_modules, find_path, find_library, find_program) is provided by
//    a package the build stage installs (mapped with dpkg -S on this Debian).
//  - Runtime packages: every shared library the built binaries load (ldd)
//    belongs to a package the runtime stage installs, to one of their
//    dependencies (apt-cache depends --recurse), or to the base image's
//    required set; every package named exists in the apt lists.
// deploy/Dockerfile.cuda (the CUDA image) gets the same shape checks with
// NVIDIA's CUDA images as bases instead: the build stage a "devel" image, the
// runtime stage the "runtime" image of the same CUDA version and Ubuntu, the
// build configured with -DTANDEM_CUDA=ON and CUDA architectures. Its package
// lists are Ubuntu's, which this Debian machine cannot resolve, so they are
// checked against the Debian Dockerfile's (checked above against ldd): the
// same build packages, and the same runtime packages under Ubuntu 24.04's
// names (NOBLE_NAMES).
// A self-test feeds broken Dockerfiles to the same checks.
//
//   node dockerfile_test.mjs --source-dir REPO [--bin NAME=PATH ...]
// Exit 0 pass, 1 fail, 77 skipped (not a Debian system: no dpkg).
import { existsSync, readFileSync, readdirSync, statSync } from 'node:fs';
import path from 'node:path';
import { Checker, parseArgs, run, skip, which } from './lib.mjs';

const args = parseArgs(process.argv.slice(2), ['bin']);
const src = args['source-dir'];
if (!src) throw new Error('--source-dir is required');
if (!which('dpkg') || !which('apt-cache')) skip('dpkg/apt-cache not found: the package checks need Debian');
const bins = (args.bin || []).map((b) => b.split(/=(.*)/s).slice(0, 2));
const c = new Checker('deploy_dockerfile');

// ---- Dockerfile parsing --------------------------------------------------------------------
// Instructions as {op, text, line}; continuation lines joined, comments dropped.
export function parseDockerfile(text) {
    const out = [];
    let cur = null;
    text.split('\n').forEach((raw, i) => {
        const line = raw.replace(/\r$/, '');
        if (/^\s*#/.test(line) || (!cur && !line.trim())) return;
        if (!cur) {
            const m = /^\s*([A-Za-z]+)\s+([\s\S]*)$/.exec(line);
            if (!m) return;
            cur = { op: m[1].toUpperCase(), text: m[2], line: i + 1 };
        } else cur.text += ` ${line.trim()}`;
        if (/\\$/.test(cur.text)) cur.text = cur.text.replace(/\\$/, '');
        else {
            cur.text = cur.text.replace(/\s+/g, ' ').trim();
            out.push(cur);
            cur = null;
        }
    });
    if (cur) out.push(cur);
    return out;
}

// Splits instructions into stages with global ARG defaults substituted into FROM.
function stagesOf(instrs) {
    const globalArgs = {};
    const stages = [];
    for (const ins of instrs) {
        if (ins.op === 'ARG' && stages.length === 0) {
            const [k, v] = ins.text.split('=');
            globalArgs[k.trim()] = (v ?? '').trim();
        } else if (ins.op === 'FROM') {
            const m = /^(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?$/i.exec(ins.text);
            const image = (m?.[1] || '').replace(/\$\{?(\w+)\}?/g, (_, k) => globalArgs[k] ?? '');
            // FROM an earlier stage (an alias, e.g. FROM ${BINARIES} AS binaries) has no base image.
            const parent = stages.find((st) => st.name === image);
            stages.push({ image, name: m?.[2] || String(stages.length), instrs: [], line: ins.line, parent });
        } else if (stages.length) stages[stages.length - 1].instrs.push(ins);
    }
    return stages;
}

// Package names an `apt-get install` in a RUN text installs (flags and shell variables skipped).
function aptPackages(runText) {
    const pk = [];
    for (const m of runText.matchAll(/apt-get\s+install\s+([^&;|]*)/g)) {
        for (const w of m[1].split(/\s+/)) if (w && !w.startsWith('-') && !w.startsWith('$')) pk.push(w);
    }
    return pk;
}

// Base-image policies: each checks the stages' FROM images.
const DEBIAN_BASES = (stages, where, chk) => {
    for (const s of stages.filter((st) => !st.parent)) {
        chk.check(/^debian:bookworm(-[a-z0-9]+)?(@sha256:[0-9a-f]{64})?$/.test(s.image), `${where}:${s.line}`,
            `stage ${s.name} is based on "${s.image}", expected debian:bookworm (tagged)`);
    }
};
const CUDA_IMAGE = /^(?:nvcr\.io\/)?nvidia\/cuda:(\d+\.\d+\.\d+)-(devel|runtime|base)-(ubuntu\d+\.\d+)(?:@sha256:[0-9a-f]{64})?$/;
const CUDA_BASES = (stages, where, chk) => {
    const flavours = stages.map((s) => CUDA_IMAGE.exec(s.image));
    stages.forEach((s, i) => {
        const m = flavours[i];
        const want = i === stages.length - 1 ? 'runtime' : 'devel';
        if (chk.check(m, `${where}:${s.line}`, `stage ${s.name} is based on "${s.image}", expected nvidia/cuda:X.Y.Z-${want}-ubuntuNN.NN`)) {
            chk.check(m[2] === want, `${where}:${s.line}`, `stage ${s.name} uses the CUDA ${m[2]} image, expected ${want}`);
        }
    });
    const tags = new Set(flavours.filter(Boolean).map((m) => `${m[1]} ${m[3]}`));
    chk.check(tags.size <= 1, where, `stages use different CUDA versions or Ubuntu releases (${[...tags].join(', ')}): the runtime must match what nvcc built against`);
};

// Stage-shape checks; returns {build, runtime} package lists.
export function checkShape(text, where, chk, sourceTargets, checkBases = DEBIAN_BASES) {
    const stages = stagesOf(parseDockerfile(text));
    chk.check(stages.length >= 2, where, `${stages.length} stage(s): expected a build stage and a runtime stage`);
    checkBases(stages, where, chk);
    const pk = { build: [], runtime: [] };
    stages.forEach((s, i) => {
        const role = i === stages.length - 1 ? 'runtime' : 'build';
        for (const ins of s.instrs) {
            const w = `${where}:${ins.line}`;
            chk.check(ins.op !== 'ADD', w, 'ADD: use COPY (ADD fetches URLs and unpacks archives implicitly)');
            if (ins.op !== 'RUN') continue;
            if (/apt-get\s+install/.test(ins.text)) {
                chk.check(/apt-get\s+update/.test(ins.text), w, 'apt-get install without apt-get update in the same RUN (stale cached lists)');
                chk.check(/--no-install-recommends/.test(ins.text), w, 'apt-get install without --no-install-recommends');
                chk.check(/-y\b/.test(ins.text), w, 'apt-get install without -y');
                chk.check(/rm -rf \/var\/lib\/apt\/lists/.test(ins.text), w, 'apt lists not removed in the same RUN');
                pk[role].push(...aptPackages(ins.text));
            }
            chk.check(!/apt-get\s+upgrade|dist-upgrade/.test(ins.text), w, 'apt-get upgrade in an image build');
            chk.check(!/(^|[;&|]\s*)apt\s/.test(ins.text), w, 'apt in a script: use apt-get (apt has no stable CLI)');
            chk.check(!/\bsudo\b/.test(ins.text), w, 'sudo in a RUN');
        }
    });
    const build = stages.slice(0, -1);
    const runtime = stages[stages.length - 1];
    const buildText = build.flatMap((s) => s.instrs.filter((x) => x.op === 'RUN').map((x) => x.text)).join('\n');
    chk.check(/-DCMAKE_BUILD_TYPE=Release\b/.test(buildText), where, 'the build does not configure CMAKE_BUILD_TYPE=Release');
    const tm = /cmake\s+--build\s+[^&]*--target\s+([^&]*)/.exec(buildText);
    if (chk.check(tm, where, 'cmake --build has no --target list (it would build every test and benchmark)')) {
        const targets = tm[1].split(/\s+/).filter((t) => t && !t.startsWith('-') && !t.startsWith('/'));
        for (const t of targets) {
            chk.check(sourceTargets.has(t), where, `builds target ${t}, which no CMakeLists.txt defines (add_executable)`);
        }
        pk.targets = targets;
    }
    if (runtime) {
        const w = `${where} stage ${runtime.name}`;
        const users = runtime.instrs.filter((x) => x.op === 'USER').map((x) => x.text.split(':')[0]);
        const last = users[users.length - 1];
        chk.check(last && last !== 'root' && last !== '0', w, `runs as ${last || 'root (no USER)'}`);
        // The stage the binaries come from, through aliases, with the ARG defaults:
        // a plain build must compile them (the stage that runs cmake --build).
        const froms = runtime.instrs.filter((x) => x.op === 'COPY').map((x) => /--from=(\S+)/.exec(x.text)?.[1]).filter(Boolean);
        const source = (name) => {
            let st = build.find((b) => b.name === name);
            while (st?.parent) st = st.parent;
            return st;
        };
        chk.check(froms.some((f) => source(f)?.instrs.some((x) => x.op === 'RUN' && /cmake\s+--build/.test(x.text))), w,
            'copies nothing from the build stage (by default the binaries must come from the stage that compiles them)');
        for (const x of runtime.instrs.filter((y) => y.op === 'CMD' || y.op === 'ENTRYPOINT')) {
            let ok = false;
            try {
                ok = Array.isArray(JSON.parse(x.text));
            } catch {
                ok = false;
            }
            chk.check(ok, `${where}:${x.line}`, `${x.op} is in shell form (signals would go to /bin/sh, not the service)`);
        }
        for (const p of pk.runtime) {
            chk.check(!/-dev$/.test(p) && !['build-essential', 'cmake', 'gcc', 'pkg-config', 'protobuf-c-compiler'].includes(p), w,
                `installs build-only package ${p} in the runtime image`);
        }
    }
    return pk;
}

// ---- the source tree ----------------------------------------------------------------------
function cmakeFiles(dir, out = []) {
    for (const n of readdirSync(dir)) {
        if (n.startsWith('.') || n.startsWith('build') || n === 'node_modules') continue;
        const p = path.join(dir, n);
        const st = statSync(p);
        if (st.isDirectory()) cmakeFiles(p, out);
        else if (n === 'CMakeLists.txt' || n.endsWith('.cmake')) out.push(p);
    }
    return out;
}

const files = cmakeFiles(src).map((f) => [f, readFileSync(f, 'utf8').replace(/#.*$/gm, '')]);
const sourceTargets = new Set(files.flatMap(([, t]) => [...t.matchAll(/add_executable\(\s*([\w-]+)/g)].map((m) => m[1])));

// Debian packages owning paths, in one dpkg call (each call costs a database
// load): path -> package or null. Each path is tried as given, resolved, and as
// its /usr-merged twin, since dpkg knows only the name the package shipped.
function ownersOf(paths) {
    const cands = new Map();
    for (const p of paths) {
        const set = new Set([p]);
        const real = run('readlink', ['-f', p]).stdout.trim();
        if (real) set.add(real);
        for (const q of [...set]) {
            if (q.startsWith('/usr/lib/')) set.add(q.slice(4));
            else if (q.startsWith('/lib/') || q.startsWith('/lib64/')) set.add(`/usr${q}`);
        }
        cands.set(p, [...set]);
    }
    const all = [...new Set([...cands.values()].flat())];
    const owner = new Map();
    if (all.length) {
        for (const line of run('dpkg', ['-S', ...all]).stdout.split('\n')) {
            const m = /^([^:,\s]+)(?::[\w-]+)?(?:, [^:]+)*: (\/.*)$/.exec(line);
            if (m) owner.set(m[2], m[1]);
        }
    }
    return new Map([...cands].map(([p, cs]) => [p, cs.map((q) => owner.get(q)).find(Boolean) || null]));
}

const multiarch = run('dpkg-architecture', ['-qDEB_HOST_MULTIARCH']).stdout.trim() || 'x86_64-linux-gnu';

// REQUIRED CMake dependencies -> the file that must exist -> its package.
function requiredDevFiles() {
    const out = [];
    for (const [f, t] of files) {
        const rel = path.relative(src, f);
        for (const m of t.matchAll(/pkg_check_modules\(\s*\w+\s+([^)]*)\)/g)) {
            if (!/\bREQUIRED\b/.test(m[1])) continue;
            for (const mod of m[1].split(/\s+/).filter((w) => w && !/^[A-Z_]+$/.test(w))) {
                const pc = [`/usr/lib/${multiarch}/pkgconfig/${mod}.pc`, `/usr/share/pkgconfig/${mod}.pc`, `/usr/lib/pkgconfig/${mod}.pc`].find(existsSync);
                out.push({ what: `pkg-config ${mod} (${rel})`, file: pc });
            }
        }
        for (const m of t.matchAll(/find_path\(\s*\w+\s+([\w./-]+)[^)]*REQUIRED/g)) {
            out.push({ what: `header ${m[1]} (${rel})`, file: [`/usr/include/${m[1]}`, `/usr/include/${multiarch}/${m[1]}`].find(existsSync) });
        }
        for (const m of t.matchAll(/find_library\(\s*\w+\s+(?:NAMES\s+)?([\w.-]+)[^)]*REQUIRED/g)) {
            out.push({ what: `library ${m[1]} (${rel})`, file: [`/usr/lib/${multiarch}/lib${m[1]}.so`, `/usr/lib/lib${m[1]}.so`].find(existsSync) });
        }
        for (const m of t.matchAll(/find_program\(\s*\w+\s+(?:NAMES\s+)?([\w.-]+)[^)]*REQUIRED/g)) {
            out.push({ what: `program ${m[1]} (${rel})`, file: which(m[1]) });
        }
    }
    return out;
}

// Packages reachable through Depends/PreDepends from the named ones.
function closure(pkgs) {
    if (!pkgs.length) return new Set();
    const r = run('apt-cache', ['depends', '--recurse', '--no-recommends', '--no-suggests', '--no-conflicts',
        '--no-breaks', '--no-replaces', '--no-enhances', ...pkgs]);
    return new Set(r.stdout.split('\n').filter((l) => l && !l.startsWith(' ') && !l.startsWith('<')).map((l) => l.trim()));
}

// What debian:bookworm-slim already has: the Essential and Priority: required packages.
function basePackages() {
    const r = run('dpkg-query', ['-W', '-f=${Package} ${Essential} ${Priority}\n']);
    return new Set(r.stdout.split('\n').filter((l) => / yes | required$/.test(l)).map((l) => l.split(' ')[0]));
}

// ---- main ---------------------------------------------------------------------------------
const dockerfile = path.join(src, 'deploy', 'Dockerfile');
const text = readFileSync(dockerfile, 'utf8');
const pk = checkShape(text, 'deploy/Dockerfile', c, sourceTargets);
console.log(`build packages: ${pk.build.join(' ')}`);
console.log(`runtime packages: ${pk.runtime.join(' ')}`);

const ignore = path.join(src, 'deploy', 'Dockerfile.dockerignore');
if (c.check(existsSync(ignore), 'deploy/Dockerfile.dockerignore', 'missing: the build context would include every build tree')) {
    const lines = readFileSync(ignore, 'utf8').split('\n').map((l) => l.trim());
    c.check(lines.some((l) => /^\/?build\*?\/?$/.test(l) || l === 'build*'), 'deploy/Dockerfile.dockerignore', 'does not exclude build*');
    c.check(lines.includes('.git'), 'deploy/Dockerfile.dockerignore', 'does not exclude .git');
}

// Every package named exists in the apt lists (one apt-cache call for all).
{
    const named = [...new Set([...pk.build, ...pk.runtime])];
    const known = new Set([...run('apt-cache', ['show', '--no-all-versions', ...named]).stdout.matchAll(/^Package: (\S+)/gm)].map((m) => m[1]));
    for (const p of named) c.check(known.has(p), 'deploy/Dockerfile', `package ${p} is not in the apt lists`);
}

// Build dependencies.
const buildSet = closure(pk.build);
const devFiles = requiredDevFiles();
const devOwners = ownersOf(devFiles.filter((d) => d.file).map((d) => d.file));
for (const d of devFiles) {
    if (!c.check(d.file, 'deploy/Dockerfile build stage', `${d.what}: not installed on this machine, cannot map it to a package`)) continue;
    const owner = devOwners.get(d.file);
    c.check(owner && buildSet.has(owner), 'deploy/Dockerfile build stage', `${d.what} comes from ${owner || '(no package)'}, which the build stage does not install`);
}

// Runtime libraries of the built binaries.
const runSet = closure(pk.runtime);
const base = basePackages();
const SANITIZER = /^lib(asan|ubsan|tsan|lsan|hwasan)\d*$/;
const neededOwners = new Set();
if (!bins.length) console.log('NOTE: no --bin given: the runtime library check is skipped (build the service targets first)');
for (const [name, p] of bins) {
    if (!c.check(existsSync(p), `binary ${name}`, `${p} does not exist (build it first)`)) continue;
    c.check(!pk.targets || pk.targets.includes(name), `binary ${name}`, 'is not among the Dockerfile build targets');
    const r = run('ldd', [p]);
    if (!c.check(r.status === 0, `binary ${name}`, `ldd failed: ${r.stderr}`)) continue;
    const libs = [];
    for (const line of r.stdout.split('\n')) {
        const m = /^\s*(\S+)\s+=>\s+(\S+)/.exec(line) || /^\s*(\/\S+)\s+\(/.exec(line);
        if (!m) continue;
        const lib = m[1];
        const file = m[2] && m[2] !== 'not' ? m[2] : m[1];
        if (c.check(!/not found/.test(line), `binary ${name}`, `${lib} not found by ldd`)) libs.push([lib, file]);
    }
    const owners = ownersOf(libs.map(([, f]) => f));
    for (const [lib, file] of libs) {
        const owner = owners.get(file);
        if (owner && SANITIZER.test(owner)) continue; // a sanitizer build's runtime, not the image's
        c.check(owner && (runSet.has(owner) || base.has(owner)), `binary ${name}`,
            `${lib} (${file}) comes from ${owner || '(no package)'}, which the runtime stage does not install`);
        if (owner && !base.has(owner)) neededOwners.add(owner);
    }
    console.log(`checked ${name}: ${p}`);
}
// Self-test of the library mapping: dropping a runtime package that provides a
// library the binaries load must leave that library uncovered.
if (bins.length) {
    // (Some are also pulled in by another listed package; at least one is not.)
    const direct = [...neededOwners].filter((o) => pk.runtime.includes(o));
    const caught = direct.filter((o) => !closure(pk.runtime.filter((x) => x !== o)).has(o));
    c.check(caught.length > 0, 'self-test "runtime package dropped"',
        `dropping any of ${direct.join(', ') || '(none)'} leaves every library covered: the check cannot fail`);
}

// ---- the CUDA image --------------------------------------------------------------------
// Debian bookworm -> Ubuntu 24.04 package names where they differ (the t64
// transition, a new utf8proc soname); every other name is the same.
const NOBLE_NAMES = { libcurl4: 'libcurl4t64', libutf8proc2: 'libutf8proc3' };

// The CUDA Dockerfile's shape, CUDA configuration and package lists against the Debian one's.
function checkCuda(cudaText, debianPk, where, chk) {
    const pk = checkShape(cudaText, where, chk, sourceTargets, CUDA_BASES);
    const stages = stagesOf(parseDockerfile(cudaText));
    const buildText = stages.slice(0, -1).flatMap((s) => s.instrs.filter((x) => x.op === 'RUN').map((x) => x.text)).join('\n');
    chk.check(/-DTANDEM_CUDA=ON\b/.test(buildText), where, 'the build does not configure -DTANDEM_CUDA=ON');
    chk.check(/-DCMAKE_CUDA_ARCHITECTURES=/.test(buildText), where, 'the build does not set CMAKE_CUDA_ARCHITECTURES (the GPUs the image runs on)');
    // The same binaries as the Debian image, plus the CUDA backend module
    // (common/engine/model/backend_module.h) where they look for it: ../lib.
    chk.check(/cmake\s+--build\s+[^&]*--target\s+tandem-cuda\b/.test(buildText), where,
        'the build does not build the CUDA backend module (--target tandem-cuda)');
    const runtimeCopies = stages[stages.length - 1].instrs.filter((x) => x.op === 'COPY').map((x) => x.text).join('\n');
    chk.check(/libtandem-cuda\.so/.test(buildText) && /\/usr\/local\/lib\/?\s*$/m.test(runtimeCopies), where,
        'the runtime stage does not put libtandem-cuda.so in /usr/local/lib (beside the binaries\' ../lib)');
    const same = (a, b) => a.size === b.size && [...a].every((x) => b.has(x));
    const want = new Set(debianPk.runtime.map((p) => NOBLE_NAMES[p] || p));
    const have = new Set(pk.runtime);
    chk.check(same(want, have), `${where} runtime stage`,
        `packages ${[...have].sort().join(' ')} are not deploy/Dockerfile's under their Ubuntu names (${[...want].sort().join(' ')})`);
    chk.check(same(new Set(debianPk.build), new Set(pk.build)), `${where} build stage`,
        `packages differ from deploy/Dockerfile's build stage (${pk.build.join(' ')} vs ${debianPk.build.join(' ')})`);
    chk.check(same(new Set(debianPk.targets || []), new Set(pk.targets || [])), where,
        'builds other targets than deploy/Dockerfile');
    return pk;
}

const cudaFile = path.join(src, 'deploy', 'Dockerfile.cuda');
let cudaText = '';
if (c.check(existsSync(cudaFile), 'deploy/Dockerfile.cuda', 'missing (the CUDA image)')) {
    cudaText = readFileSync(cudaFile, 'utf8');
    const cpk = checkCuda(cudaText, pk, 'deploy/Dockerfile.cuda', c);
    console.log(`CUDA runtime packages: ${cpk.runtime.join(' ')}`);
    const cignore = path.join(src, 'deploy', 'Dockerfile.cuda.dockerignore');
    if (c.check(existsSync(cignore), 'deploy/Dockerfile.cuda.dockerignore', 'missing: the build context would include every build tree')) {
        const lines = readFileSync(cignore, 'utf8').split('\n').map((l) => l.trim());
        c.check(lines.includes('build*') && lines.includes('.git'), 'deploy/Dockerfile.cuda.dockerignore', 'does not exclude build* and .git');
    }
}
const CUDA_MUTATIONS = [
    ['debian base', (t) => t.replace('FROM nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} AS build', 'FROM debian:bookworm AS build')],
    ['runtime on the devel image', (t) => t.replace('-runtime-${UBUNTU} AS runtime', '-devel-${UBUNTU} AS runtime')],
    ['CUDA versions differ', (t) => t.replace('FROM nvidia/cuda:${CUDA_VERSION}-runtime', 'FROM nvidia/cuda:12.4.1-runtime')],
    ['CUDA not enabled', (t) => t.replaceAll('-DTANDEM_CUDA=ON', '-DTANDEM_CUDA=OFF')],
    ['module not built', (t) => t.replace('--target tandem-cuda', '--target tandem-decode')],
    ['module not installed', (t) => t.replace('COPY --from=build /out/lib/ /usr/local/lib/', '')],
    ['runtime library dropped', (t) => t.replace('libcurl4t64 libyaml-0-2', 'libcurl4t64')],
    ['Debian package name kept', (t) => t.replace('libutf8proc3', 'libutf8proc2')],
    ['root user', (t) => t.replace(/^USER .*$/m, 'USER root')],
];
for (const [what, mutate] of cudaText ? CUDA_MUTATIONS : []) {
    const bad = mutate(cudaText);
    const probe = new Checker('probe');
    if (!c.check(bad !== cudaText, `self-test cuda "${what}"`, 'the mutation did not apply (Dockerfile.cuda changed?)')) continue;
    checkCuda(bad, pk, 'probe', probe);
    c.check(probe.errors.length > 0, `self-test cuda "${what}"`, 'the checks did not notice');
}

// Self-test: broken Dockerfiles must fail the shape checks.
const MUTATIONS = [
    ['single stage', (t) => t.replace(/FROM \$\{DEBIAN_IMAGE\} AS runtime[\s\S]*/, '')],
    ['root user', (t) => t.replace(/^USER .*$/m, 'USER root')],
    ['shell-form CMD', (t) => t.replace(/^CMD .*$/m, 'CMD tandem-decode --help')],
    ['ubuntu base', (t) => t.replace('ARG DEBIAN_IMAGE=debian:bookworm-slim', 'ARG DEBIAN_IMAGE=ubuntu:22.04')],
    ['recommends pulled in', (t) => t.replaceAll('--no-install-recommends', '')],
    ['apt lists kept', (t) => t.replaceAll('rm -rf /var/lib/apt/lists/*', 'true')],
    ['unknown target', (t) => t.replace('--target tandem-router', '--target tandem-routr')],
    ['dev package at runtime', (t) => t.replace('libyaml-0-2 \\', 'libyaml-0-2 libyaml-dev \\')],
    ['prebuilt binaries by default', (t) => t.replace('ARG BINARIES=build', 'ARG BINARIES=prebuilt')],
    ['alias stage based on Ubuntu', (t) => t.replace('FROM ${BINARIES} AS binaries', 'FROM ubuntu:24.04 AS binaries')],
];
for (const [what, mutate] of MUTATIONS) {
    const bad = mutate(text);
    const probe = new Checker('probe');
    if (!c.check(bad !== text, `self-test "${what}"`, 'the mutation did not apply (Dockerfile changed?)')) continue;
    checkShape(bad, 'probe', probe, sourceTargets);
    c.check(probe.errors.length > 0, `self-test "${what}"`, 'the checks did not notice');
}
c.report();
