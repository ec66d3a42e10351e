"""Is a float8 tensorwise linear's weight gradient bf16-representable under bf16 autocast (then
--optimizer.grad_dtype bf16 holds it exactly)?"""

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Linear(1024, 2048, bias=False), torch.nn.Linear(2048, 1024, bias=False)
).cuda()
convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name("tensorwise"))
x = torch.randn(4096, 1024, device="cuda")
for compiled in (False, True):
    model = torch.compile(net) if compiled else net
    net.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x).float().square().mean().backward()
    for name, p in net.named_parameters():
        g = p.grad
        print(
            f"compiled={compiled} {name} {type(net[0]).__name__} grad {g.dtype} bf16-exact: {torch.equal(g, g.bfloat16().float())}"
        )
