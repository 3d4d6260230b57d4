// SPDX-License-Identifier: Apache-2.0
// A deliberately simple, independent byte-level BPE over a Hugging Face
// tokenizer.json, used only to check the C tokenizer. It shares no code or data
// structure with it: added tokens are found by trying every token at every
// position, NFC is String.prototype.normalize, the split regex is a JavaScript
// regex with the `u` flag (\s spelled \p{White_Space} as in Oniguruma, (?i:...)
// spelled out as explicit case alternatives), and BPE rescans all adjacent
// pairs for the lowest rank after every merge.
//
// CLI: node bpe_ref.mjs TOKENIZER_JSON CORPUS_JSONL  -> one {"ids": [...]} per line.
import { readFileSync } from 'node:fs';

// GPT-2 bytes_to_unicode.
function byteTables() {
    const enc = new Array(256);
    let next = 256;
    for (let b = 0; b < 256; b++) {
        const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        enc[b] = String.fromCodePoint(printable ? b : next++);
    }
    const dec = new Map();
    enc.forEach((c, b) => dec.set(c, b));
    return { enc, dec };
}

// Case-insensitive group -> explicit alternatives; \s -> White_Space.
function toJsRegex(pattern) {
    const fold = (ch) => {
        const lo = ch.toLowerCase(), up = ch.toUpperCase();
        const extra = lo === 's' ? 'ſ' : lo === 'k' ? 'K' : '';
        return lo === up ? ch : `[${lo}${up}${extra}]`;
    };
    let out = '';
    for (let i = 0; i < pattern.length; i++) {
        if (pattern.startsWith('(?i:', i)) {
            // Only simple letters and | inside, which is what the known patterns use.
            let j = i + 4, depth = 1, body = '';
            for (; j < pattern.length && depth > 0; j++) {
                if (pattern[j] === '(') depth++;
                if (pattern[j] === ')') depth--;
                if (depth > 0) body += pattern[j];
            }
            out += '(?:' + [...body].map((c) => (/[a-zA-Z]/.test(c) ? fold(c) : c)).join('') + ')';
            i = j - 1;
        } else if (pattern[i] === '\\' && pattern[i + 1] === 's') {
            out += '\\p{White_Space}';
            i++;
        } else if (pattern[i] === '\\' && pattern[i + 1] === 'S') {
            out += '\\P{White_Space}';
            i++;
        } else if (pattern[i] === '\\') {
            out += pattern[i] + pattern[i + 1];
            i++;
        } else {
            out += pattern[i];
        }
    }
    return new RegExp(out, 'gu');
}

const GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

export class RefTokenizer {
    constructor(tokenizerJsonPath) {
        const tj = JSON.parse(readFileSync(tokenizerJsonPath, 'utf8'));
        this.vocab = new Map(Object.entries(tj.model.vocab));
        this.idToToken = new Map();
        for (const [t, id] of this.vocab) this.idToToken.set(id, t);
        this.ranks = new Map();
        tj.model.merges.forEach((m, i) => {
            const [a, b] = Array.isArray(m) ? m : m.split(' ');
            this.ranks.set(a + '\u0000' + b, i);
        });
        this.ignoreMerges = !!tj.model.ignore_merges;
        this.added = tj.added_tokens || [];
        for (const a of this.added) this.idToToken.set(a.id, a.content);
        this.special = new Set(this.added.filter((a) => a.special).map((a) => a.id));
        const norms = [];
        const addNorm = (n) => {
            if (!n) return;
            if (n.type === 'Sequence') n.normalizers.forEach(addNorm);
            else norms.push(n.type);
        };
        addNorm(tj.normalizer);
        this.norms = norms;
        this.stages = [];
        const addPre = (p) => {
            if (!p) return;
            if (p.type === 'Sequence') p.pretokenizers.forEach(addPre);
            else if (p.type === 'Split') this.stages.push({ re: toJsRegex(p.pattern.Regex), removed: p.behavior === 'Removed' });
            else if (p.type === 'ByteLevel') {
                this.stages.push({ prefix: p.add_prefix_space !== false, re: p.use_regex !== false ? toJsRegex(GPT2) : null });
            } else throw new Error('unsupported pre_tokenizer ' + p.type);
        };
        addPre(tj.pre_tokenizer);
        this.prefix = [];
        const addPost = (p) => {
            if (!p) return;
            if (p.type === 'Sequence') p.processors.forEach(addPost);
            if (p.type === 'TemplateProcessing') {
                for (const item of p.single) {
                    if (item.Sequence) break;
                    this.prefix.push(...p.special_tokens[item.SpecialToken.id].ids);
                }
            }
        };
        addPost(tj.post_processor);
        this.bytes = byteTables();
    }

    normalize(s) {
        for (const n of this.norms) s = s.normalize(n);
        return s;
    }

    // Splits s into [{text}|{id}] by trying each added token at each position.
    splitAdded(s, normalizedFlag) {
        const toks = this.added.filter((a) => !!a.normalized === normalizedFlag);
        const out = [];
        let textStart = 0;
        let i = 0;
        while (i < s.length) {
            let best = null;
            for (const t of toks) {
                const c = normalizedFlag ? this.normalize(t.content) : t.content;
                if (s.startsWith(c, i) && (!best || c.length > best.c.length)) best = { t, c };
            }
            if (!best) { i++; continue; }
            if (i > textStart) out.push({ text: s.slice(textStart, i) });
            out.push({ id: best.t.id });
            i += best.c.length;
            textStart = i;
        }
        if (textStart < s.length) out.push({ text: s.slice(textStart) });
        return out;
    }

    preTokenize(pieces, k) {
        if (k === this.stages.length) return pieces;
        const st = this.stages[k];
        const next = [];
        for (let p of pieces) {
            if (st.prefix && !p.startsWith(' ')) p = ' ' + p;
            if (!st.re) { next.push(p); continue; }
            let last = 0;
            for (const m of p.matchAll(st.re)) {
                if (m[0].length === 0) continue;
                if (m.index > last) next.push(p.slice(last, m.index));
                if (!st.removed) next.push(m[0]);
                last = m.index + m[0].length;
            }
            if (last < p.length) next.push(p.slice(last));
        }
        return this.preTokenize(next.filter((x) => x.length > 0), k + 1);
    }

    bpe(piece) {
        const chars = [...Buffer.from(piece, 'utf8')].map((b) => this.bytes.enc[b]);
        const word = chars.join('');
        if (this.ignoreMerges && this.vocab.has(word)) return [this.vocab.get(word)];
        let syms = chars.filter((c) => this.vocab.has(c));
        for (;;) {
            let best = -1, bestRank = Infinity;
            for (let i = 0; i + 1 < syms.length; i++) {
                const r = this.ranks.get(syms[i] + '\u0000' + syms[i + 1]);
                if (r !== undefined && r < bestRank) { bestRank = r; best = i; }
            }
            if (best < 0) break;
            syms = [...syms.slice(0, best), syms[best] + syms[best + 1], ...syms.slice(best + 2)];
        }
        return syms.map((s) => this.vocab.get(s));
    }

    encode(text, addSpecial = true) {
        const ids = addSpecial ? [...this.prefix] : [];
        for (const seg of this.splitAdded(text, false)) {
            if (seg.id !== undefined) { ids.push(seg.id); continue; }
            for (const seg2 of this.splitAdded(this.normalize(seg.text), true)) {
                if (seg2.id !== undefined) { ids.push(seg2.id); continue; }
                for (const piece of this.preTokenize([seg2.text], 0)) ids.push(...this.bpe(piece));
            }
        }
        return ids;
    }

    decode(ids, skipSpecial = false) {
        const bytes = [];
        for (const id of ids) {
            if (skipSpecial && this.special.has(id)) continue;
            const t = this.idToToken.get(id);
            const mapped = [...t].map((c) => this.bytes.dec.get(c));
            if (mapped.every((b) => b !== undefined)) bytes.push(...mapped);
            else bytes.push(...Buffer.from(t, 'utf8'));
        }
        return new TextDecoder('utf-8').decode(Uint8Array.from(bytes));
    }
}

if (import.meta.url === `file://${process.argv[1]}`) {
    const [tokJson, corpus] = process.argv.slice(2);
    const ref = new RefTokenizer(tokJson);
    for (const line of readFileSync(corpus, 'utf8').split('\n')) {
        if (!line.trim()) continue;
        console.log(JSON.stringify({ ids: ref.encode(JSON.parse(line).text) }));
    }
}
