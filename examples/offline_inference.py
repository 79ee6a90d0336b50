from jvllm import LLM, SamplingParams

prompts = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]
for out in LLM().generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, seed=0)):
    print(f"Prompt: {out.prompt!r}, Generated: {out.outputs[0].text!r}")
