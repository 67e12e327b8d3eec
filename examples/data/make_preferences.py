"""Writes the DPO example's data (examples/dpo.py), deterministically:

    preferences.jsonl     training pairs: a question, a brief answer (chosen: one sentence of
                          at most 20 words) and a long one (rejected): SmolLM2-135M-Instruct's
                          own greedy answer where that runs past 20 words (on-policy, what DPO
                          learns best from), else the brief answer drawn out with extra sentences
    brevity_heldout.jsonl held-out questions the training pairs never ask (other items of the
                          same question families, and two families no pair uses), for
                          `python -m training.evaluate`

The documented behaviour: the assistant answers in one short sentence (at most 20 words,
examples/brevity.py's `brief`). Run: python -m examples.data.make_preferences (it generates the
model's answers through the serving engine: a few minutes on a CPU).
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
USES = [
    ("What is a broom used for?", "A broom is used for sweeping floors."),
    ("What is a spoon used for?", "A spoon is used for eating and stirring food."),
    ("What is a pillow used for?", "A pillow supports your head while you sleep."),
    ("What is a shovel used for?", "A shovel is used for digging and moving soil."),
    ("What is a towel used for?", "A towel is used for drying things off."),
    ("What is a needle used for?", "A needle is used for sewing."),
    ("What is a key used for?", "A key is used for opening locks."),
    ("What is a microscope used for?", "A microscope is used to see very small things."),
    ("What is a calendar used for?", "A calendar is used to keep track of dates."),
    ("What is a wheelbarrow used for?", "A wheelbarrow is used for carrying heavy loads."),
    ("What is a candle used for?", "A candle is used to give light."),
    ("What is a fridge used for?", "A fridge is used to keep food cold."),
]
FACTS = [
    ("Name one fact about whales.", "Whales are mammals that breathe air."),
    ("Name one fact about Mars.", "Mars is called the red planet."),
    ("Name one fact about bees.", "Bees make honey from flower nectar."),
    ("Name one fact about the Pacific Ocean.", "The Pacific is the largest ocean on Earth."),
    ("Name one fact about penguins.", "Penguins are birds that cannot fly."),
    ("Name one fact about diamonds.", "Diamonds are made of carbon."),
    ("Name one fact about the heart.", "The heart pumps blood around the body."),
    ("Name one fact about Antarctica.", "Antarctica is the coldest continent."),
    ("Name one fact about owls.", "Owls hunt mostly at night."),
    ("Name one fact about rainbows.", "A rainbow forms when sunlight passes through raindrops."),
    ("Name one fact about snakes.", "Snakes have no legs."),
    ("Name one fact about the Earth.", "Earth is the third planet from the Sun."),
]
EXTRAS = [
    " This is something many people wonder about, and there is a lot more to say about it."
    " I hope this helps, and let me know if you have any other questions!",
    " To explain a little further, this follows from some basic facts that are easy to"
    " check for yourself, and it shows how simple questions lead to interesting ideas.",
    " In other words, once you know the key idea, the rest follows naturally. Many"
    " textbooks cover this topic in more detail if you would like to learn more.",
]


def drawn_out(rng, answer: str) -> str:
    """The brief answer with extra sentences after it."""
    return answer + rng.choice(EXTRAS)


def items(rng):
    """(training (question, brief answer) pairs, held-out questions)."""
    arithmetic = [(a, b) for a in range(2, 40) for b in range(2, 40)]
    rng.shuffle(arithmetic)
    sums = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a, b in arithmetic[:16]]
    legs = [(f"How many legs does a {k} have?", f"A {k} has {n} legs.") for k, n in LEGS.items()]
    tools = [(f"What does a {k} measure?", f"A {k} measures {v}.") for k, v in TOOLS.items()]
    colors = [(f"What color is {k}?", f"{k[0].upper()}{k[1:]} is {v}.") for k, v in COLORS.items()]
    opposites = [(f"What is the opposite of {k}?", f"The opposite of {k} is {v}.")
                 for k, v in OPPOSITES.items()]  # fmt: skip
    train, held_out = [], []
    for family in [sums, legs, tools, colors, opposites, list(WHY)]:
        rng.shuffle(family)
        cut = len(family) * 3 // 4
        train += family[:cut]
        held_out += [q for q, _ in family[cut:]]
    train += USES + FACTS  # families whose held-out questions ask about other things
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


def model_answers(questions: list[str]) -> list[str]:
    """SmolLM2-135M-Instruct's greedy answers (48 new tokens at most) through the engine."""
    import zoo
    from examples.chat import smollm2_gguf
    from training.evaluate import completion_text, generate_batched

    model = zoo.load_pretrained(smollm2_gguf())
    tokenizer = zoo.load_tokenizer(smollm2_gguf())
    chats = [[{"role": "user", "content": q}] for q in questions]
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in chats]
    stops = tokenizer.end_of_turn_ids
    out = generate_batched(model, prompts, max_new_tokens=48, stop_tokens=stops, batch_size=16)
    return [completion_text(tokenizer, ids, stops).strip() for ids in out]


def main() -> None:
    rng = random.Random(0)
    train, held_out = items(rng)
    answers = model_answers([q for q, _ in train])
    rows = []
    for (question, brief), own in zip(train, answers, strict=True):
        long = own if len(own.split()) > 20 else drawn_out(rng, brief)
        rows.append({"prompt": question, "chosen": brief, "rejected": long})
    rng.shuffle(rows)
    (HERE / "preferences.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (HERE / "brevity_heldout.jsonl").write_text(
        "".join(json.dumps({"prompt": q}) + "\n" for q in held_out)
    )
    on_policy = sum(r["rejected"] in answers for r in rows)
    print(f"{len(rows)} training pairs ({on_policy} rejected answers are the model's own), "
          f"{len(held_out)} held-out questions")  # fmt: skip


if __name__ == "__main__":
    main()
