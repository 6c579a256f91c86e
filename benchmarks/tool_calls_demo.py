"""Tool calls on a running server, the demo model's behaviour in three requests and a stream:
tool_choice auto and required, then the tool's result sent back (a two-step loop), then auto
streamed. Start the server first, e.g. `specdecode serve --backend llama.cpp --method auto --port 8311`,
then `python benchmarks/tool_calls_demo.py [base_url]`. Prints what came back and the times."""

import json
import sys
import time

import openai

base = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8311/v1"
c = openai.OpenAI(base_url=base, api_key="x", timeout=600)
model = c.models.list().data[0].id
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}]
msgs = [{"role": "user", "content": "What's the weather like in Paris right now? Use the tool."}]
for choice in ("auto", "required"):
    t = time.time()
    r = c.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice=choice, max_tokens=80, temperature=0)
    m = r.choices[0].message
    print(choice, round(time.time() - t, 1), "s", r.choices[0].finish_reason, repr(m.content),
          [(x.function.name, x.function.arguments) for x in m.tool_calls or []], r.specdecode if hasattr(r, "specdecode") else "")
call = m.tool_calls[0]
msgs2 = msgs + [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 14, "unit": "celsius", "sky": "cloudy"})}]
t = time.time()
r = c.chat.completions.create(model=model, messages=msgs2, tools=tools, max_tokens=60, temperature=0)
print("step 2", round(time.time() - t, 1), "s", r.choices[0].finish_reason, repr(r.choices[0].message.content), r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens)
# streamed auto
s = c.chat.completions.create(model=model, messages=msgs, tools=tools, max_tokens=80, temperature=0, stream=True)
parts = []
fin = None
for ch in s:
    d = ch.choices[0].delta
    if d.tool_calls:
        parts += [(p.index, p.function.name, p.function.arguments) for p in d.tool_calls]
    if d.content:
        parts.append(d.content)
    fin = ch.choices[0].finish_reason or fin
print("stream auto", fin, parts)
