"""A chat template that behaves as the public Qwen3 one does, written here from its documented behaviour (ChatML
turns; thinking is the default):

- the generation prompt is ``<|im_start|>assistant\\n`` in thinking mode, and adds an empty
  ``<think>\\n\\n</think>\\n\\n`` only when ``enable_thinking`` is false;
- an answer's reasoning is its ``reasoning_content``, or what its content holds before ``</think>``;
- answers after the last user message (the last query) keep their reasoning in a ``<think>`` block, the last answer
  an empty one when it has none; every answer before the last query is rendered without its reasoning.

Tool calls and tool responses, which the real template also handles, are left out: the training data has none.
"""

# Literal text sits in expressions, so that the whitespace control of the tags around it never eats its newlines.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' -%}{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_query_index=messages|length - 1, found=false) -%}"
    "{%- for message in messages[::-1] -%}"
    "{%- if not ns.found and message.role == 'user' -%}"
    "{%- set ns.found = true -%}{%- set ns.last_query_index = messages|length - 1 - loop.index0 -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- set content = message.content -%}{%- set reasoning = '' -%}"
    "{%- if message.reasoning_content is string -%}{%- set reasoning = message.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) -%}"
    "{{ '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}"
    "{%- else -%}{{ '<|im_start|>assistant\n' + content }}{%- endif -%}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}"
    "{%- endif -%}"
)
