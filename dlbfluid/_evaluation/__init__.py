"""The paper's evaluation (seed §5.4, App. B) in the fluid model: what an experiment is
(`config`), the random scenarios it draws (`generator`, from the sites of `sites`, the
servers of `server_model`, the keyed streams of `uniforms`, as a `generated` batch, with
the `events` and trials on top), the routers' step-size rule
(`step_rule`), the experiment verb (`experiment`) and the paper's findings as checks of a
recorded summary (`paper_findings`)."""
