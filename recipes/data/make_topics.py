"""Writes topics.jsonl, the recipe's embedded default dataset: short English sentences about one
of four topics (label 0 sports, 1 cooking, 2 weather, 3 technology), made from templates with a
fixed seed. A pretrained encoder learns it in a few dozen steps; the loss visibly falls.

    python recipes/data/make_topics.py   # rewrites recipes/data/topics.jsonl identically
"""

import json
import random
from pathlib import Path

TOPICS = {
    0: [
        "the striker",
        "the goalkeeper",
        "our team",
        "the coach",
        "the referee",
        "the marathon runner",
        "the tennis player",
        "the home side",
        "the captain",
        "the cyclist",
        "the league leaders",
        "the swimmer",
    ],
    1: [
        "the soup",
        "the bread dough",
        "the chef",
        "the risotto",
        "my grandmother's recipe",
        "the sauce",
        "the roast chicken",
        "the pastry",
        "the curry",
        "the salad dressing",
        "the pancake batter",
        "the stew",
    ],
    2: [
        "the storm",
        "the morning fog",
        "the forecast",
        "the heavy rain",
        "the cold front",
        "the afternoon sun",
        "the wind",
        "the snowfall",
        "the humidity",
        "the thunder",
        "the drought",
        "the spring frost",
    ],
    3: [
        "the new laptop",
        "the software update",
        "the database server",
        "the phone's battery",
        "the compiler",
        "the web browser",
        "the graphics card",
        "the cloud service",
        "the router",
        "the app",
        "the operating system",
        "the chip",
    ],
}
ACTIONS = {
    0: [
        "scored twice in the second half",
        "won the final on penalties",
        "trained hard before the match",
        "broke the course record",
        "was shown a red card",
        "celebrated the championship",
        "missed an easy shot at goal",
        "defended well all season",
    ],
    1: [
        "needs more salt and pepper",
        "simmered slowly for two hours",
        "was baked until golden",
        "tasted of garlic and lemon",
        "was served with fresh herbs",
        "burned a little at the bottom",
        "rose nicely in the warm oven",
        "was seasoned with cumin",
    ],
    2: [
        "brought flooding to the valley",
        "cleared up by noon",
        "kept everyone indoors",
        "dropped the temperature below zero",
        "made the roads icy",
        "is expected to last all week",
        "blew down several trees",
        "left the fields dry and cracked",
    ],
    3: [
        "crashed after the latest patch",
        "runs twice as fast as before",
        "drains power in the background",
        "was released with new features",
        "needs a firmware upgrade",
        "fixed the memory leak",
        "connects over a faster network",
        "compiles the project in seconds",
    ],
}
FRAMES = [
    "{s} {a}.",
    "Yesterday {s} {a}.",
    "Everyone said {s} {a}.",
    "I read that {s} {a}.",
    "Apparently {s} {a}, again.",
    "According to the report, {s} {a}.",
    "{S} {a}, which surprised nobody.",
    "Last night {s} {a}.",
]


def main() -> None:
    rng = random.Random(1234)
    rows = []
    for _ in range(1200):
        label = rng.randrange(4)
        subject = rng.choice(TOPICS[label])
        frame = rng.choice(FRAMES)
        text = frame.format(s=subject, S=subject[0].upper() + subject[1:], a=rng.choice(ACTIONS[label]))
        rows.append({"text": text[0].upper() + text[1:], "label": label})
    out = Path(__file__).with_name("topics.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
