"""Writes the DPO example's data (examples/dpo.py), deterministically:

    preferences.jsonl     training pairs: a question, a brief answer (chosen: one sentence) and
                          the same answer drawn out (rejected: a preamble or extra sentences)
    brevity_heldout.jsonl held-out questions the training pairs never ask (other items and
                          other question families), for `python -m training.evaluate`

The documented behaviour: the assistant answers in one short sentence (at most 20 words,
examples/dpo.py's `brief` checker). Run: python -m examples.data.make_preferences
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent

LEGS = {
    "spider": 8,
    "dog": 4,
    "chicken": 2,
    "ant": 6,
    "horse": 4,
    "duck": 2,
    "cat": 4,
    "beetle": 6,
    "cow": 4,
    "crab": 10,
    "goat": 4,
    "bee": 6,
    "octopus": 8,
    "pig": 4,
    "parrot": 2,
    "lobster": 10,
    "sheep": 4,
    "fly": 6,
    "scorpion": 8,
    "rabbit": 4,
}
TOOLS = {
    "thermometer": "temperature",
    "barometer": "air pressure",
    "ruler": "length",
    "scale": "weight",
    "clock": "time",
    "speedometer": "speed",
    "odometer": "the distance a vehicle has travelled",
    "hygrometer": "humidity",
    "anemometer": "wind speed",
    "voltmeter": "voltage",
    "ammeter": "electric current",
    "stopwatch": "elapsed time",
    "seismometer": "ground motion",
    "protractor": "angles",
    "altimeter": "altitude",
    "rain gauge": "rainfall",
    "light meter": "light intensity",
    "pedometer": "steps taken",
    "caliper": "small distances",
    "sound level meter": "loudness",
}
COLORS = {
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a ripe banana": "yellow",
    "a ripe tomato": "red",
    "a carrot": "orange",
    "milk": "white",
    "chocolate": "brown",
    "the clear daytime sky": "blue",
    "a lemon": "yellow",
    "a lime": "green",
    "a ripe strawberry": "red",
    "charcoal": "black",
    "an eggplant": "purple",
    "a pumpkin": "orange",
    "a raven": "black",
    "a polar bear's fur": "white",
    "a flamingo": "pink",
    "a fire truck": "red",
    "a pine tree's needles": "green",
}
OPPOSITES = {
    "hot": "cold",
    "up": "down",
    "big": "small",
    "fast": "slow",
    "early": "late",
    "happy": "sad",
    "light": "dark",
    "open": "closed",
    "full": "empty",
    "strong": "weak",
    "wet": "dry",
    "loud": "quiet",
    "rich": "poor",
    "young": "old",
    "hard": "soft",
    "long": "short",
    "heavy": "light",
    "inside": "outside",
    "true": "false",
    "push": "pull",
}
WHY = [
    ("Why is the sky blue?", "Air scatters blue sunlight more than other colors."),
    (
        "Why do leaves change color in autumn?",
        "Trees stop making green chlorophyll, so other pigments show.",
    ),
    ("Why do we have seasons?", "Earth's tilted axis changes how directly sunlight reaches us."),
    ("Why does ice float?", "Ice is less dense than liquid water."),
    ("Why do birds migrate?", "They move to places with more food and milder weather."),
    ("Why do we need sleep?", "Sleep lets the body and brain rest and repair."),
    ("Why is the ocean salty?", "Rivers carry dissolved minerals into it, and water evaporates."),
    ("Why do cats purr?", "Cats purr to communicate and often to soothe themselves."),
    ("Why does the moon change shape?", "We see different parts of its sunlit side as it orbits."),
    ("Why do onions make you cry?", "Cutting them releases a gas that irritates your eyes."),
    ("Why do we yawn?", "Yawning may help cool the brain and signal tiredness."),
    ("Why is exercise healthy?", "It strengthens the heart, muscles and bones."),
    ("Why do stars twinkle?", "Moving air in the atmosphere bends their light."),
    ("Why does bread rise?", "Yeast makes gas bubbles that expand the dough."),
    ("Why do plants need sunlight?", "They use its energy to make food by photosynthesis."),
    ("Why do metals feel cold?", "They conduct heat away from your skin quickly."),
]
PREAMBLES = [
    "Let's think about this step by step. ",
    "Great question! ",
    "That's an interesting thing to ask about. ",
    "Sure, I'd be happy to help with that. ",
]
EXTRAS = [
    " This is something many people wonder about, and there is a lot more to say about it."
    " I hope this helps, and let me know if you have any other questions!",
    " To explain a little further, this follows from some basic facts that are easy to"
    " check for yourself, and it shows how simple questions lead to interesting ideas.",
    " In other words, once you know the key idea, the rest follows naturally. Many"
    " textbooks cover this topic in more detail if you would like to learn more.",
]


def pair(rng, question: str, answer: str) -> dict:
    """The brief answer vs the same answer drawn out (extra sentences, sometimes a preamble)."""
    rejected = answer + rng.choice(EXTRAS)
    if rng.random() < 0.4:
        rejected = rng.choice(PREAMBLES) + rejected
    return {"prompt": question, "chosen": answer, "rejected": rejected}


def items(rng):
    """(question, brief answer) of every family, the training ones and the held-out ones."""
    arithmetic = [(a, b) for a in range(2, 40) for b in range(2, 40)]
    rng.shuffle(arithmetic)
    sums = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a, b in arithmetic[:40]]
    legs = [(f"How many legs does a {k} have?", f"A {k} has {n} legs.") for k, n in LEGS.items()]
    tools = [(f"What does a {k} measure?", f"A {k} measures {v}.") for k, v in TOOLS.items()]
    colors = [(f"What color is {k}?", f"{k[0].upper()}{k[1:]} is {v}.") for k, v in COLORS.items()]
    opposites = [(f"What is the opposite of {k}?", f"The opposite of {k} is {v}.")
                 for k, v in OPPOSITES.items()]  # fmt: skip
    families = [sums, legs, tools, colors, opposites, list(WHY)]
    train, held_out = [], []
    for family in families:
        rng.shuffle(family)
        cut = len(family) * 3 // 4
        train += family[:cut]
        held_out += [q for q, _ in family[cut:]]
    # Families no training pair asks, to see the behaviour generalise.
    held_out += [
        f"What is {x} used for?"
        for x in (
            "a hammer",
            "a sponge",
            "a ladder",
            "glue",
            "a kettle",
            "an umbrella",
            "a map",
            "soap",
        )
    ]
    held_out += [
        f"Name one fact about {x}."
        for x in ("the Sun", "elephants", "the Moon", "volcanoes", "honey", "the Nile")
    ]
    return train, held_out


def main() -> None:
    rng = random.Random(0)
    train, held_out = items(rng)
    rows = [pair(rng, q, a) for q, a in train]
    rng.shuffle(rows)
    (HERE / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (HERE / "brevity_heldout.jsonl").write_text(
        "".join(json.dumps({"prompt": q}) + "\n" for q in held_out)
    )
    print(f"{len(rows)} training pairs, {len(held_out)} held-out questions")


if __name__ == "__main__":
    main()
