// SPDX-License-Identifier: Apache-2.0
// The exactness test: encodes every string of the corpus with the C tokenizer
// (tandem-tokenize --jsonl) and with the JavaScript reference, and requires the
// same ids; then decodes those ids with the C tokenizer (special tokens kept
// and skipped) and requires the reference's decode, and NFC(text) for strings
// that hold no added-token text. Exits 77 (ctest: skipped) when the shared
// tokenizer folder is absent.
//
// node check_ref.mjs --tool PATH --model DIR --corpus FILE
import { existsSync, readFileSync } from 'node:fs';
import { spawnSync } from 'node:child_process';
import { RefTokenizer } from './bpe_ref.mjs';

const args = {};
for (let i = 2; i + 1 < process.argv.length; i += 2) args[process.argv[i].replace(/^--/, '')] = process.argv[i + 1];
if (!args.tool || !args.model || !args.corpus) {
    console.error('usage: node check_ref.mjs --tool PATH --model DIR --corpus FILE');
    process.exit(2);
}
const tokJson = `${args.model}/tokenizer.json`;
if (!existsSync(tokJson)) {
    console.log(`SKIPPED: ${tokJson} is absent`);
    process.exit(77);
}

const ref = new RefTokenizer(tokJson);
const texts = readFileSync(args.corpus, 'utf8').split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l).text);

// Plus seeded random strings over blocks whose characters and properties are
// the same in every Unicode version PCRE2, utf8proc and Node might carry.
let seed = 12345;
const rnd = (n) => {
    seed = (seed * 1103515245 + 12345) % 2147483648;
    return seed % n;
};
const blocks = [
    [0x20, 0x7e], [0x20, 0x7e], [0x20, 0x7e], [0xa0, 0xff], [0x100, 0x17f], [0x300, 0x36f],
    [0x391, 0x3c9], [0x410, 0x44f], [0x5d0, 0x5ea], [0x627, 0x64a], [0x660, 0x669],
    [0x3041, 0x3093], [0x30a1, 0x30f6], [0x4e00, 0x9fa5], [0xac00, 0xd7a3], [0x1f600, 0x1f64f],
    [0x2000, 0x200a], [0xff01, 0xff5e],
];
const ws = [' ', ' ', '  ', '\n', '\n\n', '\t', '\r\n', '\u00a0', '\u3000', '\u0085', "'s", "'LL"];
for (let i = 0; i < 400; i++) {
    let t = '';
    const len = 1 + rnd(24);
    for (let k = 0; k < len; k++) {
        if (rnd(5) === 0) { t += ws[rnd(ws.length)]; continue; }
        const [lo, hi] = blocks[rnd(blocks.length)];
        t += String.fromCodePoint(lo + rnd(hi - lo + 1));
    }
    texts.push(t);
}

function runTool(lines, extra = []) {
    const r = spawnSync(args.tool, ['--model', args.model, '--jsonl', ...extra], {
        input: lines.map((o) => JSON.stringify(o)).join('\n') + '\n',
        maxBuffer: 1 << 28,
    });
    if (r.status !== 0) {
        console.error(`tool failed (${r.status}): ${r.stderr}`);
        process.exit(1);
    }
    const out = r.stdout.toString('utf8').split('\n').filter((l) => l.length).map((l) => JSON.parse(l));
    if (out.length !== lines.length) {
        console.error(`tool printed ${out.length} lines for ${lines.length}`);
        process.exit(1);
    }
    return out;
}

let failures = 0;
const show = (s) => JSON.stringify(s.length > 120 ? s.slice(0, 120) + '…' : s);
const same = (a, b) => a.length === b.length && a.every((x, i) => x === b[i]);

const cIds = runTool(texts.map((text) => ({ text }))).map((o) => o.ids);
const refIds = texts.map((t) => ref.encode(t));
texts.forEach((t, i) => {
    if (!same(cIds[i], refIds[i])) {
        failures++;
        if (failures <= 20) console.error(`encode mismatch for ${show(t)}\n  C:   ${cIds[i].join(' ')}\n  ref: ${refIds[i].join(' ')}`);
    }
});

const addedContents = ref.added.map((a) => a.content);
for (const skip of [false, true]) {
    const cText = runTool(refIds.map((ids) => ({ ids })), skip ? ['--skip-special-tokens'] : []).map((o) => o.text);
    texts.forEach((t, i) => {
        const want = ref.decode(refIds[i], skip);
        if (cText[i] !== want) {
            failures++;
            if (failures <= 40) console.error(`decode(skip=${skip}) mismatch for ${show(t)}\n  C:   ${show(cText[i])}\n  ref: ${show(want)}`);
        }
        if (!skip && !addedContents.some((c) => t.includes(c)) && want !== t.normalize('NFC')) {
            failures++;
            if (failures <= 40) console.error(`decode(encode(x)) != NFC(x) for ${show(t)}`);
        }
    });
}

const nIds = refIds.reduce((a, ids) => a + ids.length, 0);
if (failures) {
    console.error(`${failures} mismatches over ${texts.length} strings`);
    process.exit(1);
}
console.log(`ok: ${texts.length} strings, ${nIds} ids, encode and decode equal to the reference`);
