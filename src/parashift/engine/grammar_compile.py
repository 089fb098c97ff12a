"""How one constraint becomes an xgrammar CompiledGrammar (run inside the grammar compile
process: engine/grammar_process.py).

JSON is generated compact (no free whitespace between tokens, as vLLM's
`disable_any_whitespace`); `json_object` is the schema {"type": "object"}: a model can never
loop on whitespace. xgrammar's strings (and a regex's negated classes) take raw control
characters and the UTF-16 surrogates U+D800-U+DFFF, which JSON forbids and UTF-8 cannot
carry (the text would not decode): they are taken out of every negated class of JSON and
regex grammars before they compile."""

from __future__ import annotations

import json
import re
from typing import Any


def compile_constraint(compiler: Any, kind: str, text: str) -> Any:
    """`kind` and `text` as StructuredOutputsParams.key gives them; ValueError naming the
    field for a constraint that does not compile."""
    import xgrammar as xgr

    try:
        if kind in ("json", "json_object"):
            schema = text if kind == "json" else '{"type": "object"}'
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                                   strict_mode=True)
            return compiler.compile_grammar(text_only(str(grammar)))
        if kind == "regex":
            return compiler.compile_grammar(text_only(str(xgr.Grammar.from_regex(text))))
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(text)))
        return compiler.compile_grammar(text)
    except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError) as e:
        raise ValueError(f"structured_outputs.{kind}: {first_line(e)}") from None


def text_only(ebnf: str) -> str:
    """`ebnf` with control characters and UTF-16 surrogates out of every negated character
    class (a `[^` inside a quoted literal or a class is left as it is)."""
    out, i, quoted, in_class = [], 0, False, False
    while i < len(ebnf):
        ch = ebnf[i]
        if ch == "\\":  # an escape: the next character is literal
            out.append(ebnf[i:i + 2])
            i += 2
            continue
        if quoted:
            quoted = ch != '"'
        elif in_class:
            in_class = ch != "]"
        elif ch == '"':
            quoted = True
        elif ch == "[":
            in_class = True
            if ebnf.startswith("[^", i):
                out.append("[^\\0-\\x1f\\uD800-\\uDFFF")
                i += 2
                continue
        out.append(ch)
        i += 1
    return "".join(out)


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of `choices` (JSON string literals are EBNF's escapes too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def first_line(error: BaseException) -> str:
    """xgrammar's message, without its log prefix ("[12:00:00] /path/file.cc:94: ")."""
    text = (str(error).strip() or type(error).__name__).splitlines()[0]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)[:500]
