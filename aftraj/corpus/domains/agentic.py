"""The agentic domain (DESIGN §4): multi-hop questions over a generated local document store with
near-name distractors; Manager + search_agent with the tools `search` and `lookup`; answers
checked by normalised match; its slip predicates, injection targets and corruptions; the
HotpotQA and GAIA readers (local copies, nothing downloads).

    from aftraj.corpus.domains.agentic import DOMAIN
    tasks = DOMAIN.generate(10, seed=0)
"""

from __future__ import annotations

import json
import random
import re
import string
from pathlib import Path

from aftraj.corpus.domains.base import (ENV, FINAL_THOUGHTS, NOTE_PERCENT, OPENING_PERCENT, OPTIONAL_UNTIL, PRECALL_PERCENT,
                                        Domain, Task, Template,
                                        act, final_text, jsonl_rows, need, one_type, say)
from aftraj.corpus.rollout import Turn
from aftraj.schema import SchemaError

# how the agents name a relation of the document store
PHRASE = {"founder": "founder", "headquarters": "headquarters city", "founded": "founding year",
          "birthplace": "birthplace", "employer": "employer", "born": "birth year"}


# =========================================================================== tasks

_FIRST = ["Ada", "Boris", "Carla", "Dmitri", "Esme", "Felix", "Greta", "Hugo", "Ines", "Jonas",
          "Katya", "Lior", "Marta", "Nils", "Olga", "Pavel", "Rhea", "Stefan", "Talia", "Ulrich"]
_LAST = ["Varga", "Lind", "Okafor", "Brandt", "Moreau", "Sato", "Keller", "Novak", "Ruiz", "Haas",
         "Ivers", "Costa", "Falk", "Quist", "Weber", "Amari", "Bauer", "Dahl", "Engel", "Gomez"]
_CO1 = ["Blue", "Iron", "North", "Silver", "Bright", "Crimson", "Quiet", "Rapid", "Golden", "Stone"]
_CO2 = ["Harbor", "Peak", "Field", "Bridge", "River", "Forge", "Lantern", "Orchard", "Summit", "Delta"]
_CO3 = ["Systems", "Works", "Labs", "Foods", "Motors", "Textiles", "Media", "Logistics"]
_CITY1 = ["Mar", "Bel", "Tor", "Vel", "Ash", "Kin", "Lor", "Pem", "Sal", "Wyn", "Dun", "Ost"]
_CITY2 = ["ton", "ford", "haven", "mere", "stead", "bury", "wick", "dale"]

# relation: (subject type, object type, question phrase, doc phrase)
_RELATIONS = {
    "founder": ("company", "person"), "headquarters": ("company", "city"),
    "founded": ("company", "year"), "birthplace": ("person", "city"),
    "employer": ("person", "company"), "born": ("person", "year"),
}


def _doc_text(name: str, kind: str, facts: dict) -> str:
    if kind == "company":
        return (f"{name} is a company headquartered in {facts['headquarters']}. It was founded in "
                f"{facts['founded']} by {facts['founder']}.")
    return (f"{name} was born in {facts['birthplace']} in {facts['born']}. {name} works at "
            f"{facts['employer']}.")


MAX_HOPS = 6   # 2 to 6 hops: runs of about 14 to 40 steps
_LINKS = {"person": ("employer", "company"), "company": ("founder", "person")}
_ENDS = {"person": ("birthplace", "born"), "company": ("headquarters", "founded")}
_END_Q = {"birthplace": "In which city was {0} born?", "born": "In what year was {0} born?",
          "headquarters": "In which city is {0} headquartered?", "founded": "In what year was {0} founded?"}
_LINK_NP = {"employer": "the company {0} works for", "founder": "the founder of {0}"}


def _chain(rng: random.Random) -> tuple[tuple[str, ...], str]:
    """A random chain (start kind, relations…) of 1 to MAX_HOPS hops and its question."""
    kind = rng.choice(["person", "company"])
    chain, np_ = [kind], "{0}"
    for _ in range(rng.randint(1, MAX_HOPS - 1)):
        rel, kind = _LINKS[kind]
        chain.append(rel)
        np_ = _LINK_NP[rel].format(np_)
    end = rng.choice(_ENDS[kind])
    chain.append(end)
    return tuple(chain), _END_Q[end].format(np_)


def gen_agentic(seed: int, i: int) -> Task:
    rng = random.Random(f"{seed}:agentic:{i}")
    (chain, qtext) = _chain(rng)
    used: set[str] = set()

    def fresh(kind: str) -> str:
        while True:
            if kind == "person":
                v = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
            elif kind == "company":
                v = f"{rng.choice(_CO1)} {rng.choice(_CO2)} {rng.choice(_CO3)}"
            elif kind == "city":
                v = rng.choice(_CITY1) + rng.choice(_CITY2)
            else:
                v = str(rng.randint(1900, 2015))
            if v not in used:
                used.add(v)
                return v

    def distractor_name(name: str, kind: str) -> str:
        if kind == "company":
            v = name + " Group"
        else:
            first, last = name.split(" ", 1)
            v = f"{first} {last}{rng.choice(['son', 'er', 'a'])}"
        used.add(v)
        return v

    entities: dict[str, dict] = {}   # name -> {"kind", "facts"}

    def make_entity(kind: str, name: str | None = None) -> str:
        name = name or fresh(kind)
        if kind == "company":
            facts = {"headquarters": fresh("city"), "founded": fresh("year"), "founder": fresh("person")}
        else:
            facts = {"birthplace": fresh("city"), "born": fresh("year"), "employer": fresh("company")}
        entities[name] = {"kind": kind, "facts": facts}
        return name

    start_kind = chain[0]
    subject = make_entity(start_kind)
    hops = []
    kind = start_kind
    for rel in chain[1:]:
        obj = entities[subject]["facts"][rel]
        hops.append({"subject": subject, "relation": rel, "answer": obj})
        # a near-name distractor of the subject, with different facts
        dname = distractor_name(subject, kind)
        make_entity(kind, dname)
        obj_kind = _RELATIONS[rel][1]
        if obj_kind in ("person", "company") and obj not in entities:
            make_entity(obj_kind, obj)
        subject, kind = obj, obj_kind
    for _ in range(rng.randint(1, 3)):  # unrelated documents
        make_entity(rng.choice(["person", "company"]))
    names = sorted(entities)
    rng.shuffle(names)
    docs = []
    for j, name in enumerate(names):
        e = entities[name]
        docs.append({"id": f"d{j + 1:02d}", "title": name, "kind": e["kind"], "facts": e["facts"],
                     "text": _doc_text(name, e["kind"], e["facts"])})
    docs.sort(key=lambda d: d["id"])
    prompt = qtext.format(hops[0]["subject"])
    return Task(id=f"agentic/{seed}-{i:05d}", domain="agentic", source="generated", prompt=prompt,
                reference=hops[-1]["answer"], data={"hops": hops, "docs": docs})


_TOKEN = re.compile(r"[a-z0-9]+")


def search_docs(docs: list[dict], query: str, k: int = 3) -> list[dict]:
    """Deterministic lexical search: token overlap with title (x2) and text; ties by id."""
    q = set(_TOKEN.findall(query.lower()))
    scored = []
    for d in docs:
        title = set(_TOKEN.findall(d["title"].lower()))
        text = set(_TOKEN.findall(d["text"].lower()))
        s = 2 * len(q & title) + len(q & text)
        if s > 0:
            scored.append((-s, d["id"], d))
    scored.sort(key=lambda x: (x[0], x[1]))
    return [d for _, _, d in scored[:k]]


def normalise_answer(s: str | None) -> str:
    """HotpotQA-style: lower case, no punctuation, no articles, single spaces."""
    if s is None:
        return ""
    s = s.lower()
    s = "".join(c for c in s if c not in string.punctuation)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def read_hotpotqa(path: str | Path, limit: int | None = None) -> list[Task]:
    """HotpotQA JSON (a list): _id, question, answer, context [[title, [sentences]]], supporting_facts."""
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SchemaError(f"invalid JSON: {e}", source=str(path), line=e.lineno) from None
    if not isinstance(rows, list):
        raise SchemaError("must be a JSON list of questions", source=str(path), line=1)
    out = []
    for n, row in enumerate(rows):
        where = {"source": str(path), "line": n + 1}
        for key in ("_id", "question", "answer", "context"):
            if not isinstance(row, dict) or key not in row:
                raise SchemaError("is missing", field=f"[{n}].{key}", **where)
        docs = []
        for j, ctx in enumerate(row["context"]):
            if not (isinstance(ctx, list) and len(ctx) == 2 and isinstance(ctx[1], list)):
                raise SchemaError("must be [title, [sentences]]", field=f"[{n}].context[{j}]", **where)
            docs.append({"id": f"d{j + 1:02d}", "title": str(ctx[0]), "kind": "page", "facts": {},
                         "text": " ".join(str(s) for s in ctx[1])})
        out.append(Task(id=f"hotpotqa/{row['_id']}", domain="agentic", source="hotpotqa",
                        prompt=str(row["question"]), reference=str(row["answer"]),
                        data={"docs": docs, "level": row.get("level"), "type": row.get("type")}))
        if limit and len(out) >= limit:
            break
    return out


def read_gaia(path: str | Path, limit: int | None = None) -> list[Task]:
    """GAIA metadata JSONL: task_id, Question, Final answer, Level, (file_name)."""
    path, out = Path(path), []
    for lineno, row in jsonl_rows(path):
        tid = str(need(row, "task_id", path, lineno))
        q, a = need(row, "Question", path, lineno), need(row, "Final answer", path, lineno)
        out.append(Task(id=f"gaia/{tid}", domain="agentic", source="gaia", prompt=str(q), reference=str(a),
                        data={"docs": [], "level": row.get("Level"), "file_name": row.get("file_name")}))
        if limit and len(out) >= limit:
            break
    return out


def doc_by_id(task: Task, did) -> dict | None:
    return next((d for d in task.data["docs"] if d["id"] == did), None)


def generate(n: int, seed: int, **_) -> list[Task]:
    """n generated multi-hop questions, each with its own document store."""
    return [gen_agentic(seed, i) for i in range(n)]


# =========================================================================== template

class AgenticTemplate(Template):
    name, domain, lead, partner = "manager_search_agent", "agentic", "Manager", "search_agent"
    tools = {"Manager": (), "search_agent": ("search", "lookup")}
    arg_schema = {"search": {"query": (str, None)}, "lookup": {"doc_id": (str, None)}}
    tool_doc = {"search": "Search the local document store; returns up to 3 (doc id, title) hits.",
                "lookup": "Return the full text of one document by its id."}
    acts = ("request", "plan", "search", "precall", "lookup", "result", "claim", "note", "redo", "confirm", "final")

    def role_prompt(self, agent: str) -> str:
        if agent == "Manager":
            return ("You are Manager. Break the question into hops, ask search_agent for each fact, "
                    "check its evidence, and finish with 'FINAL ANSWER: <answer>'.")
        return ("You are search_agent. Use search to find documents and lookup to read them; report "
                "each fact with the id of the document it came from.")

    def check_answer(self, task, answer, sandbox=None):
        ok = normalise_answer(answer) == normalise_answer(task.reference)
        return ok, "answer matches" if ok else f"answer {answer!r} != reference {task.reference!r}"

    def _run_tool(self, task, turns, call, sandbox):
        docs = task.data["docs"]
        if call.tool == "search":
            hits = search_docs(docs, call.arguments["query"])
            body = "\n".join(f"{d['id']} | {d['title']}" for d in hits) or "no results"
            return Turn(agent=ENV, kind="tool_result", content=body, tool="search",
                        result_ids=tuple(d["id"] for d in hits),
                        sim={"act": "result", "of": "search", "hits": [d["id"] for d in hits]})
        did = call.arguments["doc_id"]
        doc = next((d for d in docs if d["id"] == did), None)
        if doc is None:
            return Turn(agent=ENV, kind="tool_result", content=f"ERROR: no document {did!r}", tool="lookup",
                        result_ids=(), error=f"no document {did!r}", sim={"act": "result", "of": "lookup"})
        return Turn(agent=ENV, kind="tool_result", content=f"{doc['title']}: {doc['text']}", tool="lookup",
                    result_ids=(doc["id"],), sim={"act": "result", "of": "lookup", "doc_id": doc["id"]})

    # ------------------------------------------------------------------ turns (shared with the injector)
    def claim_turn(self, task, hop, subj, value, did, att, slip=None) -> Turn:
        rel = PHRASE[task.data["hops"][hop]["relation"]]
        thought = say(task, ("claim-t", hop, att), ("Thought: the document states it directly.",
                                                    f"Thought: that answers hop {hop + 1}.", "Thought: found the fact.",
                                                    "Thought: the document leaves no room for error here."))
        act = say(task, ("claim-a", hop, att), (f"The {rel} of {subj} is {value} (source: {did}).",
                                                f"{did} says the {rel} of {subj} is {value}.",
                                                f"Found it: {rel} of {subj} = {value} (source {did})."))
        return Turn(agent="search_agent", kind="message", content=f"{thought}\n{act}",
                    sim={"act": "claim", "hop": hop, "value": value, "doc_id": did}, slip=slip)

    def lookup_turn(self, task, hop, did, subj, att, slip=None) -> Turn:
        thought = say(task, ("lookup-t", hop, att), (f"Thought: {did} should be the page for {subj}.",
                                                     f"Thought: the best hit for {subj} is {did}.",
                                                     f"Thought: {did} matches {subj}."))
        # the id only: which page it is shows in the search result (the step never repeats a
        # distractor's title, so a wrong pick is found by reading the result, not by a word here)
        act = say(task, ("lookup-a", hop, att), (f"Reading {did}.", f"Opening {did}.", f"Opening {did} now."))
        return Turn(agent="search_agent", kind="tool_call", content=f"{thought}\n{act}", tool="lookup",
                    arguments={"doc_id": did}, sim={"act": "lookup", "hop": hop}, slip=slip)

    def search_turn(self, task, hop, subj, att, *, query: str | None = None, requery: bool = False) -> Turn:
        """A search for hop `hop`. `query`: another query than the usual one (an empty search:
        a first query with the subject misspelt, which matches nothing; not an injected type)."""
        rel = PHRASE[task.data["hops"][hop]["relation"]]
        if requery:
            thought = say(task, ("research-t", hop, att), ("Thought: no results; my query was wrong, probably a typo. Again.",
                                                           "Thought: the search failed to match anything; fixing the query."))
        else:
            thought = say(task, ("search-t", hop, att), (f"Thought: I need the {rel} of {subj}.",
                                                         f"Thought: next fact: {subj}'s {rel}."))
        act = say(task, ("search-a", hop, att), (f"Searching for the {rel} of {subj}.", f"Looking up {subj} in the store."))
        return Turn(agent="search_agent", kind="tool_call", content=f"{thought}\n{act}", tool="search",
                    arguments={"query": query or f"{subj} {rel}"},
                    sim={"act": "search", "hop": hop, **({"requery": True} if requery else {})})

    def precall_turn(self, task, hop, subj, hits) -> Turn:
        """The search agent sizes up the hits before opening one (a message where a call could stand)."""
        act = say(task, ("precall", hop), (f"{len(hits)} hit(s) for {subj}; opening the best one next.",
                                           f"The list has {', '.join(hits)}; reading the page for {subj}.",
                                           f"One of {', '.join(hits)} should be {subj}; checking."))
        return Turn(agent="search_agent", kind="message", content=f"Thought: pick the right page before reading.\n{act}",
                    sim={"act": "precall", "hop": hop})

    def confirm_turn(self, task, value, n, slip=None) -> Turn:
        act = say(task, ("confirm", n), (f"Evidence checked. The answer is {value}.",
                                         f"Every hop is backed by a document; the answer is {value}.",
                                         f"The chain holds: {value}.", f"No claim is wrong; the answer is {value}."))
        return Turn(agent="Manager", kind="message", content=f"Thought: checking each claim against the documents read.\n{act}",
                    sim={"act": "confirm", "value": value}, slip=slip)

    def final_turn(self, task, ans, slip=None) -> Turn:
        return Turn(agent="Manager", kind="final_answer", content=f"{say(task, 'final', FINAL_THOUGHTS)}\n{final_text(ans)}",
                    sim={"act": "final", "answer": ans}, slip=slip)

    def _claims(self, turns) -> tuple[dict, dict]:
        """Current claims per hop (a redo of hop i drops claims of hops >= i) and attempts per hop."""
        claims: dict[int, dict] = {}
        attempts: dict[int, int] = {}
        for t in turns:
            a = t.sim.get("act")
            if a == "claim":
                claims[t.sim["hop"]] = t.sim
            elif a == "redo":
                h = t.sim["hop"]
                attempts[h] = attempts.get(h, 0) + 1
                for k in [k for k in claims if k >= h]:
                    del claims[k]
        return claims, attempts

    def _subject(self, task, claims, hop) -> str:
        return task.data["hops"][0]["subject"] if hop == 0 else str(claims.get(hop - 1, {}).get("value", ""))

    def _check_chain(self, task, turns, claims) -> int | None:
        """The Manager's evidence check: first hop whose claim no looked-up document backs."""
        hops = task.data["hops"]
        looked = {t.sim.get("doc_id") for t in turns if t.kind == "tool_result" and t.sim.get("of") == "lookup"}
        for h in range(len(hops)):
            c = claims.get(h)
            if c is None:
                return h
            doc = doc_by_id(task, c.get("doc_id")) if c.get("doc_id") in looked else None
            subj = self._subject(task, claims, h)
            if doc is None or doc["title"] != subj or str(doc["facts"].get(hops[h]["relation"])) != str(c["value"]):
                return h
        return None

    def scripted_next(self, task, turns, ctx):
        """The next turn: the opening (plan, notes), the answer once confirmed, the hop in progress,
        or, every hop claimed, the Manager's evidence check."""
        turn = self._opening(task, turns, ctx)
        if turn is not None:
            return turn
        if turns[-1].sim.get("act") == "confirm":
            return self.final_turn(task, turns[-1].sim["value"])
        claims, attempts = self._claims(turns)
        hop = next((h for h in range(len(task.data["hops"])) if h not in claims), None)
        if hop is None:
            return self._check_evidence(task, turns, ctx, claims, attempts)
        att = attempts.get(hop, 0)
        for react in (self._on_search, self._on_lookup):
            turn = react(task, turns, ctx, claims, hop, att)
            if turn is not None:
                return turn
        return self._next_hop(task, turns, ctx, claims, hop, att)

    def _opening(self, task, turns, ctx):
        """The plan said twice, the plan, and now and then a note from each side after it."""
        hops = task.data["hops"]
        last = turns[-1]
        again = self._redundant(turns, ctx)
        if again is not None:
            return again
        if not any(t.sim.get("act") == "plan" for t in turns):
            parts = [f"hop {i + 1}: the {PHRASE[h['relation']]} of " + ("'" + h["subject"] + "'" if i == 0 else "that")
                     for i, h in enumerate(hops)]
            thought = say(task, "plan", (f"Thought: a {len(hops)}-hop question; one fact per hop.",
                                         f"Thought: {len(hops)} facts to chain, each from a document.",
                                         "Thought: follow the chain one document at a time.",
                                         "Thought: a wrong hop would fail the whole chain; one fact per hop."))
            return Turn(agent="Manager", kind="message", sim={"act": "plan"},
                        content=f"{thought}\nsearch_agent, please find " + "; ".join(parts) + ". Cite document ids.")
        if last.sim.get("act") in ("plan", "note") and last.sim.get("hop") is None and last.agent == "search_agent" \
                and ctx.pick(100, "opening") < OPENING_PERCENT:
            return Turn(agent="Manager", kind="message", sim={"act": "note", "hop": "rules"},
                        content="Thought: the evidence matters more than speed.\n" + say(task, "rules", (
                            "Remember: cite the document id for every fact.", "Good. One document per fact, please.",
                            "Fine; I will check every claim against its document.")))
        if last.sim.get("act") == "plan" and ctx.pick(100, "prenote") < OPENING_PERCENT:
            return Turn(agent="search_agent", kind="message", sim={"act": "note", "hop": None},
                        content="Thought: one hop at a time, citing each document.\n" + say(task, "prenote", (
                            f"Understood; starting with {hops[0]['subject']}.", "On it.",
                            f"Starting the chain at {hops[0]['subject']}.")))
        return None

    def _on_search(self, task, turns, ctx, claims, hop, att):
        """After a search: a new query if it found nothing, else the page to open (now and then
        announced first; a slip opens the wrong one)."""
        hops, last = task.data["hops"], turns[-1]
        if last.kind == "tool_result" and last.sim.get("of") == "search" \
                and not last.error and not last.sim.get("hits"):
            return self.search_turn(task, hop, self._subject(task, claims, hop), att, requery=True)
        if last.kind == "tool_result" and last.sim.get("of") == "search" or last.sim.get("act") == "precall":
            res = last if last.kind == "tool_result" else turns[-2]
            hits = list(res.sim.get("hits") or [])
            subj = self._subject(task, claims, hop)
            exact = [d for d in hits if (doc_by_id(task, d) or {}).get("title") == subj]
            pick = exact[0] if exact else (hits[0] if hits else "d01")
            if last.kind == "tool_result" and len(turns) + 6 * (len(hops) - len(claims)) < OPTIONAL_UNTIL + 6 and ctx.pick(100, "precall", hop, att) < PRECALL_PERCENT:
                return self.precall_turn(task, hop, subj, hits)
            slip = None
            others = [d for d in hits if d != pick]
            if others and ctx.slip("wrong_tool_argument", "lk", hop, att):
                pick, slip = others[ctx.pick(len(others), "lkpick", hop, att)], "wrong_tool_argument"
            return self.lookup_turn(task, hop, pick, subj, att, slip=slip)
        return None

    def _on_lookup(self, task, turns, ctx, claims, hop, att):
        """After a page was read: the claimed fact (a slip takes a look-alike's, or miscopies a number)."""
        last = turns[-1]
        if not (last.kind == "tool_result" and last.sim.get("of") == "lookup"):
            return None
        rel = task.data["hops"][hop]["relation"]
        doc = doc_by_id(task, last.sim.get("doc_id")) if not last.error else None
        value = str(doc["facts"].get(rel, "unknown")) if doc else "unknown"
        did = doc["id"] if doc else None
        slip = None
        subj = self._subject(task, claims, hop)
        distract = [d for d in task.data["docs"] if d["title"] != subj and d["title"].startswith(subj.split(" ")[0])
                    and rel in d["facts"] and str(d["facts"][rel]) != value]
        if distract and ctx.slip("wrong_entity", "ent", hop, att):
            value, slip = str(distract[0]["facts"][rel]), "wrong_entity"
        elif value.isdigit() and ctx.slip("computation_slip", "num", hop, att):
            value, slip = str(int(value) + [1, -1, 10][ctx.pick(3, "numd", hop, att)]), "computation_slip"
        return self.claim_turn(task, hop, subj, value, did, att, slip=slip)

    def _next_hop(self, task, turns, ctx, claims, hop, att) -> Turn:
        """After a claim: stopping early (a slip), a note, or the search for the next hop."""
        hops, last = task.data["hops"], turns[-1]
        if last.sim.get("act") == "claim" and last.sim["hop"] < len(hops) - 1 and \
                ctx.slip("premature_termination", "prem", last.sim["hop"], att):
            return self.final_turn(task, last.sim["value"], slip="premature_termination")
        if last.sim.get("act") == "claim" and ctx.pick(100, "note", last.sim["hop"], att) < NOTE_PERCENT:
            v = last.sim["value"]
            return Turn(agent="Manager", kind="message", sim={"act": "note", "hop": last.sim["hop"]},
                        content="Thought: one more link of the chain.\n" + say(task, ("note", last.sim["hop"], att), (
                            f"Got it: {v}. Next hop.", f"Noted ({v}); continue.", f"OK, {v}. Keep going.",
                            f"Got it: {v}. Nothing looks wrong so far.")))
        subj = self._subject(task, claims, hop)
        if len(turns) + 6 * (len(hops) - len(claims)) < OPTIONAL_UNTIL + 6 and ctx.detour("empty_search", "es", hop, att):
            typo = " ".join(garble(w, hop) for w in subj.split())
            if typo != subj and not search_docs(task.data["docs"], typo):
                return self.search_turn(task, hop, subj, att, query=typo)
        return self.search_turn(task, hop, subj, att)

    def _check_evidence(self, task, turns, ctx, claims, attempts) -> Turn:
        """Every hop has a claim: the Manager checks the evidence chain (a redo, or the confirmation)."""
        hops = task.data["hops"]
        n_checks = sum(1 for t in turns if t.sim.get("act") in ("redo", "confirm"))
        bad = self._check_chain(task, turns, claims)
        final = str(claims[len(hops) - 1]["value"])
        if bad is not None and sum(attempts.values()) < 2:
            if ctx.catches("check", bad, n_checks, str(claims[bad]["value"]) if bad in claims else "-"):
                return Turn(agent="Manager", kind="message", sim={"act": "redo", "hop": bad},
                            content=f"Thought: a claim does not match its document.\nThe evidence for hop {bad + 1} "
                                    f"does not hold up; search_agent, redo hop {bad + 1}.")
            return self.confirm_turn(task, final, n_checks, slip="verdict_misread")
        if bad is None and ctx.slip("verdict_misread", "verdict", n_checks):
            wrong = self._subject(task, claims, len(hops) - 1)
            return self.confirm_turn(task, wrong, n_checks, slip="verdict_misread")
        return self.confirm_turn(task, final, n_checks)


# =========================================================================== slip detector

def _claim_problem(tpl, task, turns, j) -> tuple[str, str] | None:
    t, p = turns[j], turns[j - 1]
    if act(t) != "claim" or p.kind != "tool_result" or p.sim.get("of") != "lookup" or p.error:
        return None
    doc = doc_by_id(task, (p.result_ids or [None])[0])
    rel = task.data["hops"][t.sim["hop"]]["relation"]
    if doc is None or rel not in doc["facts"]:
        return None
    fact, v = str(doc["facts"][rel]), str(t.sim["value"])
    if v == fact:
        return None
    others = {str(d["facts"][rel]) for d in task.data["docs"] if rel in d["facts"] and d["id"] != doc["id"]}
    if v in others:
        return "wrong_entity", f"reports {v}, another entity's {rel}; {doc['id']} says {fact}"
    return "computation_slip", f"reports {v} where {doc['id']} says {fact}"


detect_computation = one_type(_claim_problem, "computation_slip")
detect_entity = one_type(_claim_problem, "wrong_entity")


def detect_fabricated(tpl, task, turns, j):
    t, p = turns[j], turns[j - 1]
    if act(t) == "claim" and not (p.kind == "tool_result" and p.sim.get("of") == "lookup" and not p.error):
        return "states a fact that no lookup returned"
    return None


def detect_argument(tpl, task, turns, j):
    t = turns[j]
    if act(t) != "lookup":
        return None
    # the search this lookup follows (past an announcement of the call, or a fault and its retry)
    p = next((u for u in reversed(turns[:j]) if u.kind == "tool_result" and u.sim.get("of") in ("search", "lookup")
              and not u.sim.get("transient")), None)
    if p is None or p.sim.get("of") != "search":
        return None
    claims, _ = tpl._claims(turns[:j])
    subj = tpl._subject(task, claims, t.sim["hop"])
    exact = [h for h in (p.result_ids or ()) if (doc_by_id(task, h) or {}).get("title") == subj]
    did = (t.arguments or {}).get("doc_id")
    if exact and did not in exact:
        return f"opens {did} although the search listed {exact[0]} ({subj})"
    return None


def detect_verdict(tpl, task, turns, j):
    t = turns[j]
    if act(t) != "confirm":
        return None
    claims, _ = tpl._claims(turns[:j])
    last = len(task.data["hops"]) - 1
    if last not in claims:
        return None   # a conclusion before the work is done: premature (detect_premature)
    if str(t.sim.get("value")) != str(claims[last]["value"]):
        return f"confirms {t.sim.get('value')} although the last hop found {claims[last]['value']}"
    bad = tpl._check_chain(task, turns[:j], claims)
    if bad is not None:
        return f"confirms although the evidence for hop {bad + 1} does not hold"
    return None


def detect_premature(tpl, task, turns, j):
    t = turns[j]
    if act(t) == "confirm":
        claims, _ = tpl._claims(turns[:j])
        missing = [h for h in range(len(task.data["hops"])) if h not in claims]
        return f"concludes with {t.sim.get('value')} before hop {missing[0] + 1} is found" if missing else None
    if t.kind != "final_answer" or str(act(t)).startswith("llm_"):
        return None
    claims, _ = tpl._claims(turns[:j])
    missing = [h for h in range(len(task.data["hops"])) if h not in claims]
    if missing:
        return f"answers before hop {missing[0] + 1} is found"
    if not any(act(u) == "confirm" for u in turns[:j]):
        return "answers before the evidence is checked"
    return None


# =========================================================================== injection

def _hop_context(tpl, task, turns, k):
    claims, attempts = tpl._claims(turns[:k])
    hop = turns[k].sim["hop"]
    return hop, tpl._subject(task, claims, hop), attempts.get(hop, 0)


def garble(v: str, salt: int) -> str:
    """A typo (an empty search's query): a year off by a little, a word with its last letter changed."""
    if v.isdigit():
        return str(int(v) + [1, -1, 10][salt % 3])
    return v[:-1] + ("e" if v[-1] != "e" else "a")


def misremember(task, rel: str, v: str, salt: int) -> str | None:
    """A fact copied wrong, as a plausible value of its kind that no document gives for `rel`: a year
    off by a little, another person's surname, another city or company of the same make (never a
    misspelling a word list could spot)."""
    if v.isdigit():
        return str(int(v) + [1, -1, 10][salt % 3])
    taken = {str(d["facts"][rel]) for d in task.data["docs"] if rel in d["facts"]} | {v}
    words = v.split(" ")
    if len(words) == 2 and words[0] in _FIRST:
        cands = [f"{words[0]} {x}" for x in _LAST]
    elif len(words) >= 2 and words[0] in _CO1:
        cands = [" ".join([x, *words[1:]]) for x in _CO1] + [" ".join([words[0], x, *words[2:]]) for x in _CO2]
    else:
        cands = [a + b for a in _CITY1 for b in _CITY2]
    cands = [c for c in cands if c not in taken]
    return cands[salt % len(cands)] if cands else None


def corrupt_computation(tpl, task, turns, k, salt):
    t = turns[k]
    hop, subj, att = _hop_context(tpl, task, turns, k)
    wrong = misremember(task, task.data["hops"][hop]["relation"], str(t.sim["value"]), salt)
    return tpl.claim_turn(task, hop, subj, wrong, t.sim.get("doc_id"), att) if wrong else None


def corrupt_entity(tpl, task, turns, k, salt):
    t = turns[k]
    hop, subj, att = _hop_context(tpl, task, turns, k)
    rel = task.data["hops"][hop]["relation"]
    wrong = [doc for doc in task.data["docs"] if rel in doc["facts"] and str(doc["facts"][rel]) != str(t.sim["value"])]
    if not wrong:
        return None
    near = [doc for doc in wrong if doc["title"].startswith(subj.split(" ")[0])] or wrong
    doc = near[salt % len(near)]
    return tpl.claim_turn(task, hop, subj, str(doc["facts"][rel]), t.sim.get("doc_id"), att)


def corrupt_verdict(tpl, task, turns, k, salt):
    t = turns[k]
    claims = [u for u in turns[:k] if act(u) == "claim"]
    hops = task.data["hops"]
    wrong = hops[-1]["subject"] if len(hops) > 1 else (claims[0].sim["value"] if claims else "unknown")
    if len(claims) >= 2:
        wrong = str(claims[-2].sim["value"])
    if str(wrong) == str(t.sim.get("value")):
        return None
    n = sum(act(u) in ("redo", "confirm") for u in turns[:k])
    return tpl.confirm_turn(task, wrong, n)


def corrupt_fabricated(tpl, task, turns, k, salt):
    t = turns[k]
    hop, subj, att = _hop_context(tpl, task, turns, k)
    rel = task.data["hops"][hop]["relation"]
    wrong = sorted({str(doc["facts"][rel]) for doc in task.data["docs"] if rel in doc["facts"]}
                   - {str(task.data["hops"][hop]["answer"])})
    if not wrong:
        return None
    return tpl.claim_turn(task, hop, subj, wrong[salt % len(wrong)], t.arguments.get("doc_id"), att)


def corrupt_argument(tpl, task, turns, k, salt):
    t = turns[k]
    hop, subj, att = _hop_context(tpl, task, turns, k)
    prev = next((u for u in reversed(turns[:k]) if u.kind == "tool_result" and u.sim.get("of") == "search"), None)
    hits = [h for h in (prev.sim.get("hits") if prev else []) if h != t.arguments["doc_id"]]
    if not hits:
        return None
    return tpl.lookup_turn(task, hop, hits[salt % len(hits)], subj, att)


def corrupt_premature(tpl, task, turns, k, salt):
    """The Manager concludes where the next search should start: its usual confirmation, with the
    last fact found as the answer (the final answer follows in the replay)."""
    claims = [u for u in turns[:k] if act(u) == "claim"]
    if not claims:
        return None
    n = sum(act(u) in ("redo", "confirm") for u in turns[:k])
    return tpl.confirm_turn(task, str(claims[-1].sim["value"]), n)


DOMAIN = Domain(
    name="agentic", template=AgenticTemplate(), generate=generate,
    slips={"computation_slip": detect_computation, "verdict_misread": detect_verdict,
           "wrong_entity": detect_entity, "fabricated_tool_result": detect_fabricated,
           "wrong_tool_argument": detect_argument, "premature_termination": detect_premature},
    targets={"computation_slip": lambda task, t: act(t) == "claim" and len(str(t.sim.get("value", ""))) >= 3,
             "verdict_misread": lambda task, t: act(t) == "confirm",
             "wrong_entity": lambda task, t: act(t) == "claim",
             "fabricated_tool_result": lambda task, t: act(t) == "lookup",
             "wrong_tool_argument": lambda task, t: act(t) == "lookup",
             "premature_termination": lambda task, t: act(t) == "search" and t.sim.get("hop", 0) >= 1},
    corruptions={"computation_slip": corrupt_computation, "verdict_misread": corrupt_verdict,
                 "wrong_entity": corrupt_entity, "fabricated_tool_result": corrupt_fabricated,
                 "wrong_tool_argument": corrupt_argument, "premature_termination": corrupt_premature},
    pools={"hotpotqa": read_hotpotqa, "gaia": read_gaia},
)
