"""``env.name=gui``: a GUI agent acting on screenshots, in the spirit of DART and UI-S1 (screens rendered with PIL).

A task (a row's ``metadata["gui"]``, ``make_task``) is a sequence of screens, each a list of widgets and the goals
to reach on it, in order:

    {"size": [128, 128], "screens": [{"widgets": [...], "goals": [...]}, ...]}
    widgets: {"kind": "button", "label": "OK", "box": [x0, y0, x1, y1]}
             {"kind": "field", "label": "Name", "box": [...]}              (text typed into it once clicked)
             {"kind": "list", "items": ["a", "b", ...], "box": [...], "rows": 3}   (shows ``rows`` items at a time)
    goals:   {"click": "OK"}  {"type": {"field": "Name", "text": "Ada"}}  {"select": "b"}   (an item of the list)

The episode starts from the row's instruction with the first screenshot. Each turn of the policy ends with one
action, the last one its text names:

    click(x, y)       a pixel of the screenshot it was shown
    type("text")      into the field last clicked
    scroll(up|down)   the screen's list, by one row

and the environment answers with the next screenshot. A screen whose goals are all reached gives way to the next;
each screen completed is worth ``1 / len(screens)`` of the reward, so the whole task is 1 (a success). A turn
without an action is answered with the same screen and a note. The episode ends with the last screen or at
``env.max_turns``.

A real GUI (a browser, an emulator) plugs into the same interface: an ``Env`` whose ``reset`` returns the
instruction with a first screenshot and whose ``step`` parses the action, performs it (Playwright's
``page.mouse.click``, ``adb shell input tap``), and returns ``page.screenshot()``'s bytes (or a PIL image, a
file path) as an image part: ``docs/guides/vision.md``.
"""

from __future__ import annotations

import random
import re

from relayrl.envs.base import Env, StepResult

ACTION = re.compile(r'click\(\s*(\d+)\s*,\s*(\d+)\s*\)|type\(\s*"([^"]*)"\s*\)|scroll\(\s*(up|down)\s*\)')
HELP = 'Act with click(x, y), type("text") or scroll(up|down) on the {w}x{h} screenshot.'


class GuiError(ValueError):
    pass


def _check(task: dict, where: str) -> dict:
    """``task`` as this module draws it, or a ``GuiError`` naming what is wrong."""
    if not isinstance(task, dict) or not isinstance(task.get("screens"), list) or not task["screens"]:
        raise GuiError(f"{where}: metadata 'gui' must be {{'size': [w, h], 'screens': [{{'widgets': [...], "
                       f"'goals': [...]}}, ...]}}, got {str(task)[:80]!r}")
    for i, screen in enumerate(task["screens"]):
        for w in screen.get("widgets", []):
            if w.get("kind") not in ("button", "field", "list") or len(w.get("box") or []) != 4:
                raise GuiError(f"{where}: screen {i}: a widget is a button, field or list with a box [x0, y0, x1, y1], "
                               f"got {str(w)[:80]!r}")
        for g in screen.get("goals", []):
            if not isinstance(g, dict) or len(g) != 1 or next(iter(g)) not in ("click", "type", "select"):
                raise GuiError(f"{where}: screen {i}: a goal is {{'click': label}}, {{'type': {{'field', 'text'}}}} or "
                               f"{{'select': item}}, got {str(g)[:80]!r}")
    return task


class Screen:
    """One screen's widgets and what was done to them (the field in focus, the text typed, the list's scroll)."""

    def __init__(self, spec: dict, size: tuple[int, int]):
        self.widgets, self.goals, self.size = spec.get("widgets", []), list(spec.get("goals", [])), size
        self.focus: dict | None = None
        self.typed: dict[str, str] = {}
        self.top = 0  # the list's first visible item

    def _at(self, x: int, y: int) -> dict | None:
        return next((w for w in self.widgets if w["box"][0] <= x < w["box"][2] and w["box"][1] <= y < w["box"][3]), None)

    def _list(self) -> dict | None:
        return next((w for w in self.widgets if w["kind"] == "list"), None)

    def _row_height(self, w: dict) -> float:
        return (w["box"][3] - w["box"][1]) / w.get("rows", 3)

    def act(self, kind: str, arg) -> str | None:
        """Do one action; what it reached of the screen's goals, as the goal's kind (None: nothing)."""
        goal = self.goals[0] if self.goals else {}
        if kind == "click":
            w = self._at(*arg)
            self.focus = w
            if w is None:
                return None
            if w["kind"] == "button" and goal.get("click") == w["label"]:
                return "click"
            if w["kind"] == "list":
                row = self.top + int((arg[1] - w["box"][1]) // self._row_height(w))
                if row < len(w["items"]) and goal.get("select") == w["items"][row]:
                    return "select"
        elif kind == "type" and self.focus is not None and self.focus["kind"] == "field":
            self.typed[self.focus["label"]] = arg
            if goal.get("type") == {"field": self.focus["label"], "text": arg}:
                return "type"
        elif kind == "scroll" and (w := self._list()) is not None:
            self.top = max(0, min(self.top + (1 if arg == "down" else -1), len(w["items"]) - w.get("rows", 3)))
        return None

    def render(self):
        from PIL import Image, ImageDraw, ImageFont

        im = Image.new("RGB", self.size, "white")
        draw = ImageDraw.Draw(im)
        for w in self.widgets:
            x0, y0, x1, y1 = w["box"]
            font = ImageFont.load_default(size=max(8, min(int((y1 - y0) * 0.6), 12)))
            if w["kind"] == "button":
                draw.rectangle(w["box"], fill=(200, 200, 200), outline="black")
                draw.text(((x0 + x1) / 2, (y0 + y1) / 2), w["label"], font=font, fill="black", anchor="mm")
            elif w["kind"] == "field":
                draw.rectangle(w["box"], fill="white", outline="blue" if w is self.focus else "black")
                draw.text((x0 + 2, (y0 + y1) / 2), self.typed.get(w["label"]) or w["label"], font=font,
                          fill="black" if w["label"] in self.typed else (150, 150, 150), anchor="lm")
            else:
                draw.rectangle(w["box"], outline="black")
                h = self._row_height(w)
                for k, item in enumerate(w["items"][self.top:self.top + w.get("rows", 3)]):
                    draw.text((x0 + 2, y0 + h * (k + 0.5)), item, font=font, fill="black", anchor="lm")
        return im


class GuiEnv(Env):
    """The GUI environment (``env.name=gui``): ``explain`` appends the actions' syntax to the instruction."""

    def __init__(self, explain: bool = True):
        self.explain = explain

    async def reset(self, prompt) -> list[dict]:
        task = _check(prompt.metadata.get("gui"), f"prompt {prompt.id!r}")
        self.size = tuple(task.get("size") or (128, 128))
        self.screens, self.done = [Screen(s, self.size) for s in task["screens"]], 0
        messages = [dict(m) for m in prompt.messages]
        text = messages[-1]["content"] + (" " + HELP.format(w=self.size[0], h=self.size[1]) if self.explain else "")
        messages[-1] = {**messages[-1], "content": [self._shot(), {"type": "text", "text": text}]}
        return messages

    def _shot(self) -> dict:
        return {"type": "image", "image": self.screens[self.done].render()}

    async def step(self, text: str) -> StepResult:
        found = list(ACTION.finditer(text))
        info = {"gui_actions": len(found) > 0}
        if not found:
            return StepResult([{"role": "user", "content": [self._shot(), {"type": "text", "text": "No action."}]}],
                              info=info)
        m = found[-1]
        kind, arg = (("click", (int(m[1]), int(m[2]))) if m[1] is not None else ("type", m[3]) if m[3] is not None
                     else ("scroll", m[4]))
        screen, reward = self.screens[self.done], 0.0
        if screen.act(kind, arg) is not None:
            screen.goals.pop(0)
            if not screen.goals:
                self.done += 1
                reward = 1.0 / len(self.screens)
        if self.done == len(self.screens):
            return StepResult(reward=reward, done=True, info=info)
        return StepResult([{"role": "user", "content": [self._shot()]}], reward=reward, info=info)


WORDS = ("OK", "Send", "Next", "Save", "Open", "Done")


def make_task(rng: random.Random, size: int = 64, screens: int = 2, words=WORDS, places: int = 4) -> tuple[str, dict]:
    """(instruction, task) of a built-in task: on each of ``screens`` screens, a button and a text field in two of
    the screen's ``places`` (2: its halves, 4: its quarters); click the button the instruction names (``Click OK,
    then Save.``)."""
    specs, names = [], []
    half, m = size // 2, max(2, size // 16)
    rows = (m, half + m) if places == 4 else (size // 4,)
    slots = [[x, y, x + half - 2 * m, y + half - 2 * m] for y in rows for x in (m, half + m)]
    for _ in range(screens):
        word = rng.choice(words)
        button, field = rng.sample(slots, 2)
        specs.append({"widgets": [{"kind": "button", "label": word, "box": button},
                                  {"kind": "field", "label": "Name", "box": field}], "goals": [{"click": word}]})
        names.append(word)
    return "Click " + ", then ".join(names) + ".", {"size": [size, size], "screens": specs}


def make_rows(n: int, seed: int, id_prefix: str, **kw) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        instruction, task = make_task(rng, **kw)
        answer = ", ".join(s["goals"][0]["click"] for s in task["screens"])  # (what to click; the env rewards it)
        rows.append({"id": f"{id_prefix}-{i}", "prompt": instruction, "answer": answer, "metadata": {"gui": task}})
    return rows
