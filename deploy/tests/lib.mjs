// SPDX-License-Identifier: Apache-2.0
// Shared helpers for the deploy/ tests: command-line flags, running tools,
// the skip convention (exit 77 with a SKIPPED line, ctest SKIP_RETURN_CODE),
// an error collector, and a strict field checker for Kubernetes objects.
//
// Why a strict field checker: the JSON schemas that kubernetes-models compiles
// (Kubernetes' own OpenAPI) do not forbid unknown properties, so a misspelt
// `readinesProbe` or a `subpath` would validate and then be silently dropped
// by the API server (or rejected only with --validate=strict against a live
// cluster). The package's TypeScript declarations list every field of every
// type; checkFields() walks an object against them and reports any key the
// type does not declare.
import { execFileSync, spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';

export const SKIP = 77;

// --name value pairs into an object; repeated names collect into arrays when
// the name is listed in multi.
export function parseArgs(argv, multi = []) {
    const out = {};
    for (let i = 0; i < argv.length; i++) {
        const a = argv[i];
        if (!a.startsWith('--')) throw new Error(`unexpected argument "${a}"`);
        const eq = a.indexOf('=');
        let name, value;
        if (eq > 0) {
            name = a.slice(2, eq);
            value = a.slice(eq + 1);
        } else {
            name = a.slice(2);
            value = argv[++i];
            if (value === undefined) throw new Error(`${a}: expected a value`);
        }
        if (multi.includes(name)) (out[name] ??= []).push(value);
        else out[name] = value;
    }
    return out;
}

export function skip(why) {
    console.log(`SKIPPED: ${why}`);
    process.exit(SKIP);
}

// Absolute path of an executable on PATH (or the given path if it exists), or null.
export function which(cmd) {
    if (!cmd) return null;
    if (cmd.includes('/')) return existsSync(cmd) ? cmd : null;
    for (const dir of (process.env.PATH || '').split(':')) {
        const p = path.join(dir || '.', cmd);
        if (existsSync(p)) return p;
    }
    return null;
}

// Runs a command; returns {status, stdout, stderr} (never throws on exit code).
export function run(cmd, args, opts = {}) {
    const r = spawnSync(cmd, args, { encoding: 'utf8', maxBuffer: 64 << 20, ...opts });
    if (r.error) return { status: -1, stdout: '', stderr: String(r.error) };
    return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

export function runOk(cmd, args, opts = {}) {
    return execFileSync(cmd, args, { encoding: 'utf8', maxBuffer: 64 << 20, ...opts });
}

// Collects failures with a context prefix; report() prints them and exits.
export class Checker {
    constructor(name) {
        this.name = name;
        this.errors = [];
        this.passed = 0;
    }
    fail(where, msg) {
        const e = `${where}: ${msg}`;
        if (!this.errors.includes(e)) this.errors.push(e);
    }
    check(cond, where, msg) {
        if (cond) this.passed++;
        else this.fail(where, msg);
        return cond;
    }
    report() {
        for (const e of this.errors) console.log(`FAIL ${e}`);
        console.log(`${this.name}: ${this.passed} checks passed, ${this.errors.length} failed`);
        process.exit(this.errors.length ? 1 : 0);
    }
}

// ---- strict fields from the TypeScript declarations ----------------------------------
const requireHere = createRequire(import.meta.url);

function stripComments(text) {
    return text.replace(/\/\*[\s\S]*?\*\//g, '').replace(/^\s*\/\/.*$/gm, '');
}

// Index of the bracket closing the one at text[open] ('{' or '<').
function matchClose(text, open) {
    const o = text[open];
    const c = o === '{' ? '}' : o === '<' ? '>' : ')';
    let depth = 0;
    for (let i = open; i < text.length; i++) {
        if (text[i] === o) depth++;
        else if (text[i] === c && --depth === 0) return i;
    }
    throw new Error(`unbalanced ${o} at ${open}`);
}

// Splits an object-type body at top-level ';' into `"name"?: type` members.
function splitMembers(body) {
    const out = [];
    let depth = 0,
        start = 0;
    for (let i = 0; i < body.length; i++) {
        const ch = body[i];
        if (ch === '{' || ch === '<' || ch === '(') depth++;
        else if (ch === '}' || ch === '>' || ch === ')') depth--;
        else if (ch === ';' && depth === 0) {
            out.push(body.slice(start, i).trim());
            start = i + 1;
        }
    }
    if (body.slice(start).trim()) out.push(body.slice(start).trim());
    return out;
}

class TypeIndex {
    constructor() {
        this.files = new Map(); // d.ts path -> {imports, iface}
    }
    // Loads a declaration file: its imports (name -> resolved d.ts path) and its
    // first exported interface parsed into a type node.
    load(file) {
        if (this.files.has(file)) return this.files.get(file);
        const text = stripComments(readFileSync(file, 'utf8'));
        const imports = new Map();
        for (const m of text.matchAll(/import\s*\{([^}]*)\}\s*from\s*"([^"]+)"/g)) {
            for (const name of m[1].split(',').map((s) => s.trim()).filter(Boolean)) {
                imports.set(name, m[2]);
            }
        }
        const entry = { file, imports, node: null };
        this.files.set(file, entry);
        const im = /export interface (\w+)(?:\s+extends\s+[\w, ]+)?\s*\{/.exec(text);
        if (im) {
            const open = im.index + im[0].length - 1;
            entry.node = this.parseObject(text.slice(open + 1, matchClose(text, open)), entry);
        }
        return entry;
    }
    resolveImport(spec, fromFile) {
        let base;
        if (spec.startsWith('.')) base = path.resolve(path.dirname(fromFile), spec);
        else {
            // "pkg/sub/path": find the package's folder from here.
            const parts = spec.split('/');
            const pkg = spec.startsWith('@') ? parts.slice(0, 2).join('/') : parts[0];
            const rest = parts.slice(pkg.split('/').length).join('/');
            const pj = requireHere.resolve(`${pkg}/package.json`);
            base = path.join(path.dirname(pj), rest);
        }
        for (const cand of [`${base}.d.ts`, path.join(base, 'index.d.ts')]) if (existsSync(cand)) return cand;
        return null;
    }
    parseObject(body, ctx) {
        const fields = new Map();
        for (const m of splitMembers(body)) {
            const fm = /^"?([\w$.\-/]+)"?(\?)?\s*:\s*([\s\S]*)$/.exec(m);
            if (!fm) continue; // index signatures handled by parseType
            fields.set(fm[1], this.parseType(fm[3].trim(), ctx));
        }
        return { kind: 'object', fields };
    }
    parseType(t, ctx) {
        if (t.startsWith('Array<') && matchClose(t, 5) === t.length - 1) {
            return { kind: 'array', of: this.parseType(t.slice(6, -1).trim(), ctx) };
        }
        if (t.startsWith('{') && matchClose(t, 0) === t.length - 1) {
            const inner = t.slice(1, -1).trim();
            const idx = /^\[key:\s*string\]\s*:\s*([\s\S]*?);?$/.exec(inner);
            if (idx) return { kind: 'map', of: this.parseType(idx[1].trim(), ctx) };
            return this.parseObject(inner, ctx);
        }
        if (/^\w+$/.test(t) && ctx.imports.has(t)) {
            return { kind: 'ref', spec: ctx.imports.get(t), from: ctx.file };
        }
        return { kind: 'leaf', text: t };
    }
    deref(node) {
        while (node && node.kind === 'ref') {
            const file = this.resolveImport(node.spec, node.from);
            if (!file) return { kind: 'leaf', text: node.spec };
            const e = this.load(file);
            node = e.node || { kind: 'leaf', text: node.spec };
        }
        return node;
    }
}

const typeIndex = new TypeIndex();

// Declaration file of a model module ("kubernetes-models/apps/v1/Deployment").
export function declarationOf(moduleSpec) {
    const js = requireHere.resolve(moduleSpec);
    return js.replace(/\.js$/, '.d.ts');
}

// Reports every key of obj that the declared type does not have, as
// "spec.template.spec.containers[0].readinesProbe".
export function checkFields(obj, dtsFile, where, report) {
    const root = typeIndex.load(dtsFile).node;
    const walk = (value, node, p) => {
        node = typeIndex.deref(node);
        if (!node || value === null || value === undefined) return;
        if (node.kind === 'array') {
            if (Array.isArray(value)) value.forEach((v, i) => walk(v, node.of, `${p}[${i}]`));
        } else if (node.kind === 'map') {
            if (typeof value === 'object') for (const [k, v] of Object.entries(value)) walk(v, node.of, `${p}.${k}`);
        } else if (node.kind === 'object') {
            if (typeof value !== 'object' || Array.isArray(value)) return;
            for (const [k, v] of Object.entries(value)) {
                const q = p ? `${p}.${k}` : k;
                if (!node.fields.has(k)) report(where, `unknown field "${q}"`);
                else walk(v, node.fields.get(k), q);
            }
        }
    };
    walk(obj, root, '');
}
