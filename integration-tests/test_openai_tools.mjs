// SPDX-License-Identifier: Apache-2.0
// Tool calling through the official OpenAI SDK for Node.js (npm `openai`,
// pinned in package.json) against one Tandem endpoint started with
// --enable-auto-tool-choice --tool-call-parser hermes. The model has random
// weights, so what it says is meaningless; the checks are on shapes the SDK
// parsed: tools accepted and rendered into the prompt, tool_choice "auto"
// answering valid messages (streamed and not, the same for a greedy request),
// a conversation carrying assistant tool_calls and tool results answered,
// refusals as BadRequestError naming the field, and with --forced the forced
// calls (tool_choice named / "required", and "auto" steered into Qwen's
// <tool_call> syntax by a regex constraint) parsed into tool_calls, then a
// round trip sending the tool's result back.
//   node test_openai_tools.mjs --base-url URL --model NAME --label router [--forced] [--rendered]
// Exit 0 when every check passed; 1 with the failed check on stderr.
import assert from 'node:assert/strict';
import OpenAI from 'openai';

function arg(name) {
    const i = process.argv.indexOf(name);
    if (i < 0 || i + 1 >= process.argv.length)
        throw new Error(`missing ${name}`);
    return process.argv[i + 1];
}

const baseURL = arg('--base-url');
const model = arg('--model');
const label = arg('--label');
const forced = process.argv.includes('--forced');     // the sampler enforces constraints
const rendered = process.argv.includes('--rendered'); // the template renders tools
const client = new OpenAI({ baseURL, apiKey: 'tandem-test', maxRetries: 0, timeout: 120000 });

const WEATHER = {
    type: 'function',
    function: {
        name: 'get_weather',
        description: 'Get the current weather in a city',
        parameters: {
            type: 'object',
            properties: { city: { type: 'string', maxLength: 12 },
                          unit: { type: 'string', enum: ['celsius', 'fahrenheit'] } },
            required: ['city', 'unit'],
            additionalProperties: false,
        },
    },
};
const TIME = {
    type: 'function',
    function: { name: 'get_time', description: 'The time now', parameters: { type: 'object',
        properties: { tz: { type: 'string', enum: ['UTC', 'CET'] } }, required: ['tz'],
        additionalProperties: false } },
};
const ASK = [{ role: 'user', content: 'What is the weather in Paris?' }];
const base = { model, temperature: 0, max_tokens: 48 };

// A message's tool calls are well formed: ids, type, a known name, JSON arguments.
function checkCalls(calls, names, what) {
    assert.ok(Array.isArray(calls) && calls.length > 0, `${what}: tool_calls ${JSON.stringify(calls)}`);
    const ids = new Set();
    for (const tc of calls) {
        assert.match(tc.id, /^chatcmpl-tool-[0-9a-f]{32}$/, `${what}: id ${tc.id}`);
        assert.ok(!ids.has(tc.id), `${what}: ids are unique`);
        ids.add(tc.id);
        assert.equal(tc.type, 'function', `${what}: type`);
        assert.ok(names.includes(tc.function.name), `${what}: name ${tc.function.name}`);
        const args = JSON.parse(tc.function.arguments); // must parse
        assert.equal(typeof args, 'object', `${what}: arguments ${tc.function.arguments}`);
    }
}

// Raw SSE chunks of a streamed request, reassembled as a client would.
async function streamed(req) {
    const stream = await client.chat.completions.create({ ...req, stream: true });
    let content = '', finish = null, first = {}, calls = [];
    for await (const chunk of stream) {
        for (const sc of chunk.choices) {
            if (sc.delta.content)
                content += sc.delta.content;
            for (const d of sc.delta.tool_calls ?? []) {
                assert.ok(Number.isInteger(d.index), 'delta.tool_calls[].index');
                if (!calls[d.index]) {
                    // The first delta of a call carries its id, type and name.
                    assert.ok(d.id && d.type === 'function' && d.function?.name,
                              `first delta of call ${d.index}: ${JSON.stringify(d)}`);
                    calls[d.index] = { id: d.id, type: d.type,
                                       function: { name: d.function.name, arguments: '' } };
                    first[d.index] = true;
                } else {
                    assert.equal(d.id, undefined, 'id only in the first delta');
                    assert.equal(d.function?.name, undefined, 'name only in the first delta');
                }
                calls[d.index].function.arguments += d.function?.arguments ?? '';
            }
            if (sc.finish_reason)
                finish = sc.finish_reason;
        }
    }
    assert.ok(!content.includes('<tool_call'), `no marker in streamed content: ${content}`);
    return { content, finish, calls };
}

async function rendering() {
    const without = await client.chat.completions.create({ ...base, messages: ASK, max_tokens: 1 });
    const auto = await client.chat.completions.create(
        { ...base, messages: ASK, tools: [WEATHER, TIME], max_tokens: 1 });
    const none = await client.chat.completions.create(
        { ...base, messages: ASK, tools: [WEATHER, TIME], tool_choice: 'none', max_tokens: 1 });
    // tool_choice "none" renders the tools too (vLLM's default).
    assert.equal(none.usage.prompt_tokens, auto.usage.prompt_tokens, 'none renders the tools');
    if (rendered)
        assert.ok(auto.usage.prompt_tokens > without.usage.prompt_tokens + 50,
                  `tools in the prompt: ${auto.usage.prompt_tokens} vs ${without.usage.prompt_tokens}`);
    return `tools rendered (${without.usage.prompt_tokens} -> ${auto.usage.prompt_tokens} prompt tokens)`;
}

async function auto() {
    const req = { ...base, messages: ASK, tools: [WEATHER, TIME], tool_choice: 'auto' };
    const c = await client.chat.completions.create(req);
    const ch = c.choices[0];
    assert.equal(ch.message.role, 'assistant');
    assert.ok(Array.isArray(ch.message.tool_calls), 'message.tool_calls is a list');
    if (ch.message.tool_calls.length > 0) {
        checkCalls(ch.message.tool_calls, ['get_weather', 'get_time'], 'auto');
        assert.equal(ch.finish_reason, 'tool_calls');
    } else {
        assert.equal(typeof ch.message.content, 'string', 'content when no call');
        assert.ok(['stop', 'length'].includes(ch.finish_reason), ch.finish_reason);
    }
    const s = await streamed(req);
    assert.equal(s.content, ch.message.content ?? '', 'streamed content == non-stream (greedy)');
    assert.equal(s.finish, ch.finish_reason, 'same finish_reason');
    assert.equal(s.calls.length, ch.message.tool_calls.length, 'same number of calls');
    return `auto ok (${ch.message.tool_calls.length} calls, finish ${ch.finish_reason})`;
}

async function history() {
    const messages = [
        ...ASK,
        { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function',
            function: { name: 'get_weather', arguments: '{"city": "Paris", "unit": "celsius"}' } }] },
        { role: 'tool', tool_call_id: 'call_1', content: '{"temperature": 21}' },
    ];
    const req = { ...base, messages, tools: [WEATHER, TIME], tool_choice: 'none' };
    const c = await client.chat.completions.create(req);
    assert.equal(typeof c.choices[0].message.content, 'string', 'an answer after the tool result');
    assert.deepEqual(c.choices[0].message.tool_calls, [], 'tool_choice none: no calls parsed');
    const s = await streamed(req);
    assert.equal(s.content, c.choices[0].message.content, 'streamed answer == non-stream');
    return `history with a tool result ok (${c.usage.prompt_tokens} prompt tokens)`;
}

async function refusals() {
    const bad = async (body, param, what) => {
        await assert.rejects(client.chat.completions.create({ ...base, messages: ASK, ...body }),
            (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === param,
            what);
    };
    await bad({ tools: [WEATHER], tool_choice: { type: 'function', function: { name: 'nope' } } },
              'tool_choice', 'unknown function in tool_choice');
    await bad({ tools: [WEATHER, WEATHER] }, 'tools', 'duplicate tool names');
    await bad({ tools: [{ type: 'function', function: { name: 'x', parameters: 'no' } }] }, 'tools',
              'parameters not an object');
    await bad({ tool_choice: 'required' }, 'tool_choice', 'tool_choice without tools');
    await bad({ messages: [{ role: 'assistant', tool_calls: [{ id: '1', type: 'function',
        function: { name: 'f', arguments: '{oops' } }] }] }, 'messages', 'arguments not JSON');
    if (!forced)
        await bad({ tools: [WEATHER], tool_choice: 'required' }, 'tool_choice',
                  'required is refused while constraints are not enforced');
    return 'refusals ok';
}

// A forced call (random weights: the grammar writes it), streamed and not, then
// its result sent back. 256 tokens leave room for the whitespace the grammar
// allows (up to 4 bytes per place); without parallel_tool_calls "required"
// makes one call, so the array ends.
async function roundTrip(choice, what) {
    const req = { ...base, max_tokens: 256, messages: ASK, tools: [WEATHER, TIME], tool_choice: choice,
                  parallel_tool_calls: false };
    const c = await client.chat.completions.create(req);
    const msg = c.choices[0].message;
    checkCalls(msg.tool_calls, ['get_weather', 'get_time'],
               `${what} (finish ${c.choices[0].finish_reason}, content ${JSON.stringify(msg.content)})`);
    assert.equal(msg.content, null, `${what}: content null with only calls`);
    const s = await streamed(req);
    assert.deepEqual(s.calls.map((t) => [t.function.name, t.function.arguments]),
                     msg.tool_calls.map((t) => [t.function.name, t.function.arguments]),
                     `${what}: streamed calls == non-stream (greedy)`);
    // Send the results back; the model answers.
    const results = msg.tool_calls.map((tc) => ({ role: 'tool', tool_call_id: tc.id,
        content: JSON.stringify({ ok: true, name: tc.function.name }) }));
    const answer = await client.chat.completions.create({ ...base, tools: [WEATHER, TIME],
        tool_choice: 'none', messages: [...ASK, msg, ...results] });
    assert.equal(typeof answer.choices[0].message.content, 'string', `${what}: answer`);
    const sa = await streamed({ ...base, tools: [WEATHER, TIME], tool_choice: 'none',
                                messages: [...ASK, msg, ...results] });
    assert.equal(sa.content, answer.choices[0].message.content, `${what}: streamed answer`);
    return msg.tool_calls;
}

async function forcedCalls() {
    const named = await roundTrip({ type: 'function', function: { name: 'get_weather' } }, 'named');
    assert.equal(named.length, 1);
    assert.equal(named[0].function.name, 'get_weather');
    const a = JSON.parse(named[0].function.arguments);
    assert.ok(typeof a.city === 'string' && ['celsius', 'fahrenheit'].includes(a.unit),
              `named arguments follow the schema: ${named[0].function.arguments}`);
    const required = await roundTrip('required', 'required');
    // "auto" with the hermes parser: a regex constraint makes the random model
    // write Qwen's syntax, which the parser turns into a call.
    const regex = '<tool_call>\\n\\{"name": "get_time", "arguments": \\{"tz": "(UTC|CET)"\\}\\}\\n</tool_call>';
    const req = { ...base, max_tokens: 128, messages: ASK, tools: [WEATHER, TIME], tool_choice: 'auto',
                  structured_outputs: { regex } };
    const c = await client.chat.completions.create(req);
    checkCalls(c.choices[0].message.tool_calls, ['get_time'], 'auto via regex');
    assert.equal(c.choices[0].finish_reason, 'tool_calls', 'auto: finish_reason tool_calls');
    assert.equal(c.choices[0].message.content, null, 'auto: no content besides the call');
    const s = await streamed(req);
    assert.equal(s.finish, 'tool_calls');
    assert.equal(s.calls.length, 1);
    assert.equal(s.calls[0].function.arguments, c.choices[0].message.tool_calls[0].function.arguments);
    return `forced calls ok (named ${named[0].function.arguments}, required ${required.length} ` +
           `call(s), auto ${s.calls[0].function.arguments})`;
}

try {
    const steps = [rendering, auto, history, refusals];
    if (forced)
        steps.push(forcedCalls);
    for (const step of steps)
        console.log(`${label}: ${await step()}`);
} catch (e) {
    console.error(`FAIL ${label}: ${e.stack || e}`);
    process.exit(1);
}
