// SPDX-License-Identifier: Apache-2.0
// The official OpenAI SDK for Node.js (npm `openai`, pinned in package.json)
// against one Tandem endpoint: completions and chat completions, streaming and
// not, structured outputs (chat.completions.parse with a json_schema
// response_format, the stream helper, guided_choice; zodResponseFormat with the
// npm `zod` package, also pinned, through parse and the stream helper), a model
// list and errors. Every check is on what the SDK parsed: ids,
// object types, choices, finish_reason, usage, and that the streamed deltas
// concatenated equal the non-stream text for the same greedy request.
//   node test_openai_sdk.mjs --base-url http://127.0.0.1:8000/v1 --model NAME --label router
// Exit 0 when every check passed; 1 with the failed check on stderr.
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { zodResponseFormat } from 'openai/helpers/zod';
import { z } from 'zod';

function arg(name) {
    const i = process.argv.indexOf(name);
    if (i < 0 || i + 1 >= process.argv.length)
        throw new Error(`missing ${name}`);
    return process.argv[i + 1];
}

const baseURL = arg('--base-url');
const model = arg('--model');
const label = arg('--label');
// Tandem needs no key unless --api-key is set; the SDK insists on one.
const client = new OpenAI({ baseURL, apiKey: 'tandem-test', maxRetries: 0, timeout: 60000 });

function checkUsage(usage, what) {
    assert.ok(usage, `${what}: usage missing`);
    assert.ok(Number.isInteger(usage.prompt_tokens) && usage.prompt_tokens > 0,
              `${what}: prompt_tokens ${usage.prompt_tokens}`);
    assert.ok(Number.isInteger(usage.completion_tokens) && usage.completion_tokens > 0,
              `${what}: completion_tokens ${usage.completion_tokens}`);
    assert.equal(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens,
                 `${what}: total_tokens`);
}

async function completions() {
    const req = { model, prompt: 'The official client says', max_tokens: 16, temperature: 0 };
    const c = await client.completions.create(req);
    assert.match(c.id, /^cmpl-/, 'completion id');
    assert.equal(c.object, 'text_completion');
    assert.equal(c.model, model);
    assert.ok(Number.isInteger(c.created) && c.created > 1.6e9, `created ${c.created}`);
    assert.equal(c.choices.length, 1);
    const ch = c.choices[0];
    assert.equal(ch.index, 0);
    assert.equal(typeof ch.text, 'string');
    assert.ok(['length', 'stop'].includes(ch.finish_reason), `finish_reason ${ch.finish_reason}`);
    checkUsage(c.usage, 'completion');
    if (ch.finish_reason === 'length')
        assert.equal(c.usage.completion_tokens, 16, 'length after max_tokens');

    // A loglikelihood request as lm-evaluation-harness sends it: the prompt
    // echoed with every token's logprob (the first has none).
    const ll = await client.completions.create(
        { model, prompt: 'The capital of France is Paris', max_tokens: 1, temperature: 0,
          echo: true, logprobs: 1 });
    const lc = ll.choices[0];
    assert.ok(lc.text.startsWith('The capital of France is Paris'), `echo text ${lc.text}`);
    const tl = lc.logprobs.token_logprobs;
    assert.equal(tl.length, ll.usage.prompt_tokens + 1, 'one entry per prompt token + 1');
    assert.equal(tl[0], null, 'the first prompt token has no logprob');
    assert.equal(lc.logprobs.top_logprobs[0], null);
    assert.ok(tl.slice(1).every((x) => typeof x === 'number' && x <= 0), `logprobs ${tl}`);
    assert.equal(lc.logprobs.text_offset[0], 0);

    const stream = await client.completions.create(
        { ...req, stream: true, stream_options: { include_usage: true } });
    let text = '', finish = null, usage = null, id = null, chunks = 0;
    for await (const chunk of stream) {
        id = id ?? chunk.id;
        assert.equal(chunk.id, id, 'one id per stream');
        assert.equal(chunk.object, 'text_completion');
        assert.equal(chunk.model, model);
        if (chunk.usage)
            usage = chunk.usage;
        for (const sc of chunk.choices) {
            assert.equal(sc.index, 0);
            text += sc.text;
            chunks++;
            if (sc.finish_reason)
                finish = sc.finish_reason;
        }
    }
    assert.match(id, /^cmpl-/);
    assert.ok(chunks >= 1, 'no chunks');
    assert.ok(ch.text.length > 0, 'non-empty text (the tiny test model always produces some)');
    assert.equal(text, ch.text, 'streamed text == non-stream text (greedy)');
    assert.equal(finish, ch.finish_reason, 'same finish_reason');
    checkUsage(usage, 'completion stream');
    assert.deepEqual([usage.prompt_tokens, usage.completion_tokens],
                     [c.usage.prompt_tokens, c.usage.completion_tokens], 'same usage');
    return `completions ok (${c.usage.completion_tokens} tokens, ${chunks} chunks)`;
}

async function chat() {
    const req = {
        model,
        messages: [
            { role: 'system', content: 'You are a test.' },
            { role: 'user', content: 'Say something about serving.' },
        ],
        max_tokens: 12,
        temperature: 0,
    };
    const c = await client.chat.completions.create(req);
    assert.match(c.id, /^chatcmpl-/, 'chat id');
    assert.equal(c.object, 'chat.completion');
    assert.equal(c.model, model);
    assert.equal(c.choices.length, 1);
    const ch = c.choices[0];
    assert.equal(ch.index, 0);
    assert.equal(ch.message.role, 'assistant');
    assert.equal(typeof ch.message.content, 'string');
    assert.ok(['length', 'stop'].includes(ch.finish_reason), `finish_reason ${ch.finish_reason}`);
    checkUsage(c.usage, 'chat');

    const stream = await client.chat.completions.create(
        { ...req, stream: true, stream_options: { include_usage: true } });
    let content = '', role = null, finish = null, usage = null, id = null, chunks = 0;
    for await (const chunk of stream) {
        id = id ?? chunk.id;
        assert.equal(chunk.id, id, 'one id per stream');
        assert.equal(chunk.object, 'chat.completion.chunk');
        assert.equal(chunk.model, model);
        if (chunk.usage)
            usage = chunk.usage;
        for (const sc of chunk.choices) {
            chunks++;
            if (sc.delta.role)
                role = role ?? sc.delta.role;
            if (sc.delta.content)
                content += sc.delta.content;
            if (sc.finish_reason)
                finish = sc.finish_reason;
        }
    }
    assert.match(id, /^chatcmpl-/);
    assert.equal(role, 'assistant', 'first delta carries the role');
    assert.ok(ch.message.content.length > 0, 'non-empty content');
    assert.equal(content, ch.message.content, 'streamed deltas == non-stream content (greedy)');
    assert.equal(finish, ch.finish_reason, 'same finish_reason');
    checkUsage(usage, 'chat stream');
    assert.deepEqual([usage.prompt_tokens, usage.completion_tokens],
                     [c.usage.prompt_tokens, c.usage.completion_tokens], 'same usage');

    // The SDK's stream helper assembles the same message.
    const runner = client.chat.completions.stream(req);
    const final = await runner.finalChatCompletion();
    assert.equal(final.choices[0].message.content, ch.message.content, 'stream helper content');
    return `chat ok (${c.usage.completion_tokens} tokens, ${chunks} chunks)`;
}

// Structured outputs through the SDK's own helpers: chat.completions.parse
// (message.parsed) and the stream helper with a json_schema response_format,
// a guided_choice completion (a vLLM field passed through the body), and the
// SDK's BadRequestError for two constraints at once. The schema is bounded
// everywhere so that a random-weight model always completes it.
const SCHEMA = {
    type: 'object',
    properties: {
        name: { type: 'string', maxLength: 6 },
        tags: { type: 'array', items: { enum: ['red', 'green', 'blue'] }, minItems: 1, maxItems: 3 },
        pos: { type: 'object', properties: { x: { enum: [1, 20, 300] }, ok: { type: 'boolean' } },
               required: ['x', 'ok'] },
    },
    required: ['name', 'tags', 'pos'],
};

function checkRecord(v, what) {
    assert.equal(typeof v, 'object', `${what}: not an object`);
    assert.deepEqual(Object.keys(v), ['name', 'tags', 'pos'], `${what}: keys`);
    assert.ok(typeof v.name === 'string' && [...v.name].length <= 6, `${what}: name ${v.name}`);
    assert.ok(Array.isArray(v.tags) && v.tags.length >= 1 && v.tags.length <= 3 &&
              v.tags.every((t) => ['red', 'green', 'blue'].includes(t)), `${what}: tags`);
    assert.deepEqual(Object.keys(v.pos), ['x', 'ok'], `${what}: pos keys`);
    assert.ok([1, 20, 300].includes(v.pos.x) && typeof v.pos.ok === 'boolean', `${what}: pos`);
}

async function structured() {
    const req = {
        model,
        messages: [{ role: 'user', content: 'Describe the sky as a JSON record.' }],
        max_tokens: 300,
        temperature: 1,
        seed: 3,
        response_format: { type: 'json_schema',
                           json_schema: { name: 'sky', strict: true, schema: SCHEMA } },
    };
    const c = await client.chat.completions.parse(req);
    const msg = c.choices[0].message;
    assert.equal(c.choices[0].finish_reason, 'stop', 'structured chat finish');
    checkRecord(msg.parsed, 'chat.completions.parse');
    const runner = client.chat.completions.stream(req);
    const final = await runner.finalChatCompletion();
    assert.equal(final.choices[0].message.content, msg.content, 'streamed == non-stream (seeded)');
    // (the stream helper fills .parsed only for the SDK's zod formats)
    checkRecord(JSON.parse(final.choices[0].message.content), 'stream helper');

    const choices = ['yes', 'no', 'maybe later'];
    // Room for the longest choice spelled one byte per token (a sampled, not
    // the canonical, tokenization: 11 tokens) and its EOS: with 10 tokens an
    // unseeded run could end 'length' on a complete "maybe later".
    const cc = await client.completions.create(
        { model, prompt: 'Is the sky blue?', max_tokens: 16, guided_choice: choices });
    assert.ok(choices.includes(cc.choices[0].text), `guided_choice: ${cc.choices[0].text}`);
    assert.equal(cc.choices[0].finish_reason, 'stop');

    await assert.rejects(
        client.chat.completions.create({ ...req, guided_regex: 'a+' }),
        (e) => e instanceof OpenAI.BadRequestError && e.status === 400 &&
               /only use one kind of structured outputs/.test(e.message),
        'two constraints -> BadRequestError');
    await assert.rejects(
        client.chat.completions.create({ ...req, response_format: { type: 'json_schema',
            json_schema: { name: 'n', schema: { type: 'number', multipleOf: 0.5 } } } }),
        (e) => e instanceof OpenAI.BadRequestError && /multipleOf 0.5 is not supported/.test(e.message),
        'unsupported keyword -> BadRequestError');
    return `structured outputs ok (${JSON.stringify(msg.parsed)}, ${cc.choices[0].text})`;
}

// The SDK's zod helpers (issue 12's test): zodResponseFormat turns a zod schema
// into the json_schema response_format (strict, additionalProperties false, a
// nullable field as anyOf with null, literals as const), and parse / the
// stream helper run the model's content through the zod schema into
// message.parsed (the SDK throws if it does not validate). The checks below
// repeat the validation by hand, so a lenient helper cannot hide a bad output.
const ZodRecord = z.object({
    name: z.string().max(6),
    tags: z.array(z.enum(['red', 'green', 'blue'])).min(1).max(3),
    pos: z.object({ x: z.union([z.literal(1), z.literal(20), z.literal(300)]), ok: z.boolean() }),
    mood: z.enum(['calm', 'busy']).nullable(),
});

function checkZodRecord(v, what) {
    assert.ok(v && typeof v === 'object', `${what}: parsed is ${v}`);
    assert.deepEqual(Object.keys(v), ['name', 'tags', 'pos', 'mood'], `${what}: keys`);
    assert.ok(typeof v.name === 'string' && [...v.name].length <= 6, `${what}: name ${v.name}`);
    assert.ok(Array.isArray(v.tags) && v.tags.length >= 1 && v.tags.length <= 3 &&
              v.tags.every((t) => ['red', 'green', 'blue'].includes(t)), `${what}: tags`);
    assert.deepEqual(Object.keys(v.pos), ['x', 'ok'], `${what}: pos keys`);
    assert.ok([1, 20, 300].includes(v.pos.x) && typeof v.pos.ok === 'boolean', `${what}: pos`);
    assert.ok(v.mood === null || ['calm', 'busy'].includes(v.mood), `${what}: mood ${v.mood}`);
    assert.ok(ZodRecord.safeParse(v).success, `${what}: zod rejects ${JSON.stringify(v)}`);
}

async function zodStructured() {
    const responseFormat = zodResponseFormat(ZodRecord, 'sky_record');
    assert.equal(responseFormat.type, 'json_schema');
    assert.equal(responseFormat.json_schema.strict, true);
    const parsedSeen = [];
    for (const seed of [5, 11]) {
        const req = {
            model,
            messages: [{ role: 'user', content: 'Describe the sky as a JSON record.' }],
            max_tokens: 300,
            temperature: 1,
            seed,
            response_format: responseFormat,
        };
        const c = await client.chat.completions.parse(req);
        const ch = c.choices[0];
        assert.equal(ch.finish_reason, 'stop', `zod parse finish (seed ${seed})`);
        assert.ok(ch.message.refusal == null, 'no refusal'); // absent or null
        checkZodRecord(ch.message.parsed, `zod parse (seed ${seed})`);
        assert.deepEqual(ch.message.parsed, JSON.parse(ch.message.content), 'parsed == content');
        checkUsage(c.usage, 'zod parse');

        // The stream helper: it parses the final message with the zod schema and
        // reports the partial JSON as it grows. How many events carry it is the
        // server's pacing (a busy HTTP thread rightly merges tokens into one
        // event, as vLLM does): the test checks each event's shape and that
        // they add up to the content, never their number (issue 28, item 8).
        let deltas = 0, lastSnapshot = '';
        const runner = client.chat.completions.stream(req);
        runner.on('content.delta', (e) => {
            deltas++;
            // (A token that ends inside a UTF-8 character adds "" until the
            // character is complete.)
            assert.ok(typeof e.delta === 'string', `content.delta event ${deltas}: ${e.delta}`);
            assert.equal(e.snapshot, lastSnapshot + e.delta,
                         `content.delta ${deltas}: snapshot = the previous one + delta`);
            lastSnapshot = e.snapshot;
        });
        const final = await runner.finalChatCompletion();
        const fm = final.choices[0].message;
        assert.equal(final.choices[0].finish_reason, 'stop', 'zod stream finish');
        assert.equal(fm.content, ch.message.content, 'streamed == non-stream (seeded)');
        assert.equal(lastSnapshot, fm.content, 'content.delta snapshots end at the content');
        assert.ok(deltas >= 1 && lastSnapshot.length > 0, `content.delta events: ${deltas}`);
        checkZodRecord(fm.parsed, `zod stream helper (seed ${seed})`);
        parsedSeen.push(JSON.stringify(ch.message.parsed));
    }
    return `zod structured outputs ok (${parsedSeen.join(', ')})`;
}

// The schemas the SDK's users write (issue 28, item 2): zod idioms through
// zodResponseFormat, and Pydantic-style schemas written by hand (there is no
// PyPI here: model_json_schema()'s shapes, titles, $defs, Optional as anyOf
// null, conint/confloat bounds), each paired with a zod validator. Every one
// goes through chat.completions.parse; every output must validate. Strings are
// bounded: a random-weights model under a constraint closes an unbounded
// string only by chance (the unbounded formats are covered by grammar_test).
const pydantic = (name, properties, required, defs) => ({
    type: 'json_schema',
    json_schema: {
        name, strict: true,
        schema: { ...(defs ? { $defs: defs } : {}), title: name, type: 'object', properties,
                  required, additionalProperties: false },
    },
});
const SCHEMA_TABLE = [
    ['zod int', z.object({ n: z.number().int() })],
    ['zod int nonnegative', z.object({ n: z.number().int().nonnegative() })],
    ['zod positive', z.object({ p: z.number().positive() })],
    ['zod int gte lte', z.object({ r: z.number().int().gte(1).lte(5) })],
    ['zod gt lt', z.object({ t: z.number().gt(-10).lt(10) })],
    ['zod int negative', z.object({ n: z.number().int().lt(0) })],
    ['zod int multipleOf', z.object({ m: z.number().int().multipleOf(5) })],
    ['zod multipleOf 0.01', z.object({ price: z.number().multipleOf(0.01).nonnegative() })],
    ['zod ipv4', z.object({ ip: z.ipv4() })],
    ['zod uuid', z.object({ id: z.uuid() })],
    ['zod iso date', z.object({ d: z.iso.date() })],
    ['zod string min max', z.object({ s: z.string().min(2).max(8) })],
    ['zod enum array', z.object({ tags: z.array(z.enum(['a', 'b', 'c'])).min(1).max(3) })],
    ['zod nullable enum', z.object({ mood: z.enum(['calm', 'busy']).nullable() })],
    ['zod discriminated union', z.object({ shape: z.discriminatedUnion('kind', [
        z.object({ kind: z.literal('circle'), r: z.number().int().gte(1).lte(9) }),
        z.object({ kind: z.literal('box'), w: z.number().int().gte(1).lte(9), on: z.boolean() }),
    ]) })],
    ['zod nested', z.object({ a: z.object({ ok: z.boolean(), v: z.literal('x'),
                                             n: z.number().int().gte(-3).lte(3) }) })],
    // Bounded numbers (conint(gt=0, le=1000), condecimal(ge=0, le=10000,
    // decimal_places=2)): the test model's random logits can favour one digit
    // so strongly that an unbounded number runs to max_tokens, seed for seed
    // (the pydantic item with unbounded qty did once the draw changed).
    ['pydantic item', pydantic('Item', {
        name: { title: 'Name', type: 'string', maxLength: 8 },
        qty: { title: 'Qty', type: 'integer', exclusiveMinimum: 0, maximum: 1000 },
        price: { title: 'Price', type: 'number', minimum: 0, maximum: 10000, multipleOf: 0.01 } },
        ['name', 'qty', 'price']),
     // (JSON Schema's integer, not zod's .int(): Python's int has no safe range)
     z.object({ name: z.string().max(8), qty: z.number().gt(0).lte(1000).refine(Number.isInteger),
                price: z.number().gte(0).lte(10000).multipleOf(0.01) })],
    ['pydantic optional', pydantic('Note', {
        note: { anyOf: [{ type: 'string', maxLength: 6 }, { type: 'null' }], default: null,
                title: 'Note' } }, ['note']),
     z.object({ note: z.string().max(6).nullable() })],
    ['pydantic enum $defs conint', pydantic('Paint', {
        color: { $ref: '#/$defs/Color' },
        coats: { title: 'Coats', type: 'integer', minimum: 1, maximum: 4 } }, ['color', 'coats'],
        { Color: { enum: ['red', 'green'], title: 'Color', type: 'string' } }),
     z.object({ color: z.enum(['red', 'green']), coats: z.number().int().gte(1).lte(4) })],
    ['pydantic conlist of conint', pydantic('Scores', {
        scores: { title: 'Scores', type: 'array', minItems: 1, maxItems: 4,
                  items: { type: 'integer', minimum: 0, maximum: 100 } } }, ['scores']),
     z.object({ scores: z.array(z.number().int().gte(0).lte(100)).min(1).max(4) })],
    ['pydantic IPv4Address', pydantic('Host', {
        ip: { title: 'Ip', type: 'string', format: 'ipv4' } }, ['ip']),
     z.object({ ip: z.ipv4() })],
    ['pydantic condecimal', pydantic('Payment', {
        amount: { title: 'Amount', type: 'number', exclusiveMinimum: 0, maximum: 1000,
                  multipleOf: 0.01 } }, ['amount']),
     z.object({ amount: z.number().gt(0).lte(1000).multipleOf(0.01) })],
    ['pydantic confloat ge le', pydantic('Ratio', {
        r: { title: 'R', type: 'number', minimum: -1, maximum: 1 } }, ['r']),
     z.object({ r: z.number().gte(-1).lte(1) })],
];

async function schemaTable() {
    let n = 0;
    for (const [name, schema, check] of SCHEMA_TABLE) {
        const isZod = check === undefined;
        const req = {
            model,
            messages: [{ role: 'user', content: `Give a JSON value for ${name}.` }],
            max_tokens: 400,
            temperature: 1,
            seed: 7 + n,
            response_format: isZod ? zodResponseFormat(schema, name.replace(/\W+/g, '_')) : schema,
        };
        let c;
        try {
            c = await client.chat.completions.parse(req);
        } catch (e) {
            throw new Error(`${name}: ${e.message}\n  schema ${JSON.stringify(req.response_format)}`);
        }
        const ch = c.choices[0];
        assert.equal(ch.finish_reason, 'stop', `${name}: finish ${ch.finish_reason}`);
        const v = ch.message.parsed;
        const res = (isZod ? schema : check).safeParse(v);
        assert.ok(res.success, `${name}: ${ch.message.content} does not validate: ` +
                  JSON.stringify(res.error?.issues));
        assert.ok(Number.isFinite(JSON.stringify(v).length), name);
        n++;
    }
    return `${n} SDK schemas (zod and Pydantic-style) parsed and validated`;
}

async function models() {
    const page = await client.models.list();
    const ids = page.data.map((m) => m.id);
    assert.ok(ids.includes(model), `models: ${ids}`);
    assert.equal(page.data[0].object, 'model');
    // An unknown model: the SDK raises its typed 404 with the server's message.
    await assert.rejects(
        client.completions.create({ model: 'no-such-model', prompt: 'x', max_tokens: 1 }),
        (e) => e instanceof OpenAI.NotFoundError && e.status === 404 &&
               typeof e.message === 'string' && e.message.length > 0,
        'unknown model -> NotFoundError');
    // A bad value: BadRequestError.
    await assert.rejects(
        client.completions.create({ model, prompt: 'x', max_tokens: 1, temperature: -1 }),
        (e) => e instanceof OpenAI.BadRequestError && e.status === 400,
        'temperature -1 -> BadRequestError');
    return `models and errors ok (${ids.join(', ')})`;
}

try {
    for (const step of [completions, chat, structured, zodStructured, schemaTable, models])
        console.log(`${label}: ${await step()}`);
} catch (e) {
    console.error(`FAIL ${label}: ${e.stack || e}`);
    process.exit(1);
}
